"""The CLI's --early-exit (HF's assistant_early_exit): what test_cli.py leaves open (mutation round 5)."""

import pytest

import speculative_kernels
from speculative_kernels.cli import main
from helpers.checkpoints import save_decoder_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_decoder_pair(tmp_path_factory.mktemp("pair"))


def test_gamma_is_the_early_exit_drafts_length(pair, capsys, monkeypatch):
    """--gamma with --early-exit sets how many tokens the first layers draft per iteration (it is passed on, as
    with --draft), in the timed run and its warm-up."""
    target, _ = pair
    calls = []

    def recording(*args, **kwargs):
        calls.append({k: kwargs.get(k) for k in ("assistant_early_exit", "num_speculative_tokens")})
        return generate(*args, **kwargs)

    generate = speculative_kernels.generate  # (run_generate imports it from the package when it runs)
    monkeypatch.setattr(speculative_kernels, "generate", recording)
    code = main(["generate", "--target", str(target), "--early-exit", "1", "--gamma", "2",
                 "--prompt", "def add(a, b): return a + b", "--max-new-tokens", "8"])
    assert code == 0, capsys.readouterr()
    assert calls and all(call == {"assistant_early_exit": 1, "num_speculative_tokens": 2} for call in calls)
