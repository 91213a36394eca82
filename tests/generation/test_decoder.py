"""The server-facing decoder object: step-by-step tokens equal generate's output."""

import contextlib

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama


def test_session_steps_reproduce_generate():
    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(1))
    expected = target.generate(ids, max_new_tokens=15, do_sample=False, pad_token_id=0)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, max_new_tokens=15, do_sample=False, pad_token_id=0)
    streamed = [[] for _ in range(3)]
    while not session.finished:
        for row, tokens in enumerate(session.step()):
            streamed[row].extend(tokens)
    assert torch.equal(session.sequences(), expected)
    assert not session.sequences().is_inference()  # a copy the user may edit or train on, as generate's output
    for row in range(3):
        assert streamed[row] == expected[row, 6:].tolist()
    assert session.stats.target_forwards == session.iterations
    with pytest.raises(RuntimeError, match="finished"):
        session.step()


def test_session_refuses_output_options():
    target = llama()
    with pytest.raises(ValueError, match="streamer"):
        sk.SpeculativeDecoder(target, target).start(torch.ones(1, 3, dtype=torch.int64), streamer=object())


def _count_score_buffers(monkeypatch) -> list:
    from speculative_kernels.generation import loop

    made, make = [], loop.SpeculativeLoop._score_buffer
    monkeypatch.setattr(loop.SpeculativeLoop, "_score_buffer", lambda self: made.append(1) or make(self))
    return made


@contextlib.contextmanager
def _model_asks_for_scores(model):
    """The model's generation_config asks for a dict output with scores and logits (restored afterwards)."""
    config = model.generation_config
    config.return_dict_in_generate, config.output_scores, config.output_logits = True, True, True
    try:
        yield
    finally:
        config.return_dict_in_generate, config.output_scores, config.output_logits = False, False, False


def test_session_output_options_in_a_generation_config_are_refused_and_model_defaults_ignored(monkeypatch):
    """A generation_config passed to start() asking for an output object or scores is refused as the keywords are
    (it was accepted and ignored); the model's own defaults for them do not apply to a session, which must not
    collect [B, T, V] scores that nothing returns (it did: a buffer per output, filled every step)."""
    from transformers import GenerationConfig

    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    for name in ("return_dict_in_generate", "output_scores", "output_logits"):
        with pytest.raises(ValueError, match=f"{name} \\(in generation_config\\) is not available on a session"):
            decoder.start(ids, generation_config=GenerationConfig(max_new_tokens=4, **{name: True}))
    made = _count_score_buffers(monkeypatch)
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    with _model_asks_for_scores(target):
        session = decoder.start(ids, max_new_tokens=8, do_sample=False)
        while not session.finished:
            session.step()
    assert torch.equal(session.sequences(), expected) and made == []


def test_scores_are_collected_only_for_a_dict_output(monkeypatch):
    """output_scores/output_logits without return_dict_in_generate: model.generate returns the tensor and collects
    nothing (its stopping criteria get scores=None); ours allocated and filled both [B, T, V] buffers anyway (and
    counted them in the memory check, which could refuse a request HF runs)."""
    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    made = _count_score_buffers(monkeypatch)
    expected = target.generate(ids, max_new_tokens=8, do_sample=False, output_scores=True, output_logits=True)
    got = sk.generate(target, ids, draft_model=draft, max_new_tokens=8, output_scores=True, output_logits=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, expected) and made == []
    out = sk.generate(target, ids, draft_model=draft, max_new_tokens=8, output_scores=True,
                      return_dict_in_generate=True)
    assert len(out.scores) == 8 and out.logits is None and made == [1]


def test_phase_timer_stays_bounded_over_a_long_run():
    """A server's running batch may iterate for hours: the timer folds completed spans into a total (on CUDA it
    kept two events per phase per iteration, forever), keeping the last span of each phase and the same sums."""
    from speculative_kernels.generation.stats import PhaseTimer

    timer, other = PhaseTimer(torch.device("cpu")), PhaseTimer(torch.device("cpu"))
    for _ in range(1000):
        timer.start("step")
        timer.stop("step")
    assert len(timer.spans["step"]) < PhaseTimer.FOLD_AT
    begin, end = timer.spans["step"][-1]
    assert timer.last("step") == end - begin
    total = timer.seconds("step")
    assert total >= timer.last("step") and total == timer.folded["step"] + sum(e - b for b, e in timer.spans["step"])
    other.start("step")
    other.stop("step")
    timer.merge(other)
    # (the same spans summed in another order: equal up to float reassociation)
    assert timer.seconds("step") == pytest.approx(total + other.seconds("step"), rel=1e-9)
    assert timer.last("step") == end - begin


def test_continuous_batching_ignores_the_model_output_defaults(monkeypatch):
    """add_request returns token ids: a model whose generation_config asks for a dict output with scores and logits
    must not have the running batch collect them."""
    target, draft = llama(), llama(layers=1, seed=2)
    made = _count_score_buffers(monkeypatch)
    expected = target.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, do_sample=False)[0, 4:].tolist()
    with _model_asks_for_scores(target):
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
        request = decoder.add_request([5, 6, 7, 8], max_new_tokens=8, do_sample=False)
        while decoder.has_work():
            decoder.step()
    assert decoder.result(request).token_ids == expected and made == []


@pytest.mark.parametrize("name", ["tokenizer", "num_speculative_tokens", "backend", "draft_model", "assistant_model",
                                  "drafter", "assistant_tokenizer"])
def test_start_refuses_the_decoders_own_settings_by_name(name):
    """generate's keywords that the decoder holds for every session reached build_loop twice: a TypeError "got
    multiple values for keyword argument" (tokenizer= for stop_strings, as generate takes it), or, for
    assistant_model, a ValueError calling it unsupported by generate. Now a ValueError saying where it goes."""
    target = llama()
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens=2)
    with pytest.raises(ValueError, match=f"{name} is a setting of the decoder, not of start"):
        decoder.start(torch.ones(1, 3, dtype=torch.int64), max_new_tokens=2, **{name: None})
    lookup = sk.SpeculativeDecoder(target, prompt_lookup_num_tokens=2)  # (its own, given again)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens is a setting of the decoder, not of start"):
        lookup.start(torch.ones(1, 3, dtype=torch.int64), max_new_tokens=2, prompt_lookup_num_tokens=3)


def test_the_decoder_refuses_what_is_not_a_generating_model_when_built():
    """SpeculativeDecoder("not a model") was accepted and failed at the first add_request with an AttributeError;
    a model that cannot generate was called 'not a PreTrainedModel'."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    target = llama()
    with pytest.raises(TypeError, match="target must be a Hugging Face model that generates .* got str"):
        sk.SpeculativeDecoder("not a model", target)
    with pytest.raises(TypeError, match="draft must be a Hugging Face model that generates .* got str"):
        sk.SpeculativeDecoder(target, "not a model")
    classifier = LlamaForSequenceClassification(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(TypeError, match="draft_model must be a Hugging Face model that generates .* got "
                                        "LlamaForSequenceClassification"):
        sk.generate(target, torch.tensor([[5, 6]]), draft_model=classifier)
    # (generate read model.config before any check: an AttributeError)
    with pytest.raises(TypeError, match="model must be a Hugging Face model that generates .* got str"):
        sk.generate("not a model", torch.tensor([[5, 6]]), draft_model=target)


def test_a_session_whose_step_raised_refuses_to_go_on():
    """A stopping criterion raising once left the iteration half-done (tokens written, caches not rolled back): a
    caller stepping on emitted that iteration's tokens twice, other output than model.generate, silently. Later
    steps now raise, saying why; sequences() still returns what was emitted."""
    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    calls = {"n": 0}

    def flaky(input_ids, scores, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("transient")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, max_new_tokens=15, do_sample=False, pad_token_id=0, stopping_criteria=[flaky])
    with pytest.raises(RuntimeError, match="transient"):
        while not session.finished:
            session.step()
    with pytest.raises(RuntimeError, match=r"an earlier step\(\) raised \(RuntimeError: transient\)"):
        session.step()
    expected = target.generate(ids, max_new_tokens=15, do_sample=False, pad_token_id=0)
    emitted = session.sequences()
    assert torch.equal(emitted, expected[:, : emitted.shape[1]])


def test_a_callback_calling_the_session_step_again_is_refused_by_name():
    """A stopping criterion (or processor, streamer) that calls session.step() ran a nested iteration: it returned
    tokens model.generate does not make, then the outer step died with a bare KeyError from the phase timer. The
    nested call is refused by name; the outer step fails as any step that raises midway."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    target, draft = llama(), llama(layers=1, seed=2)
    holder = {}

    class Reenter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            holder["session"].step()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    holder["session"] = session = decoder.start(torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False,
                                                stopping_criteria=StoppingCriteriaList([Reenter()]))
    with pytest.raises(RuntimeError, match="step\\(\\) is already running"):
        session.step()
    with pytest.raises(RuntimeError, match="an earlier step\\(\\) raised"):
        session.step()


def test_a_session_stepped_from_two_threads_runs_their_steps_one_after_the_other():
    """Another thread's step() during a running one was refused as if a callback had called it (or, an instant
    earlier, ran a second iteration over the same buffers at once). It waits for the running step now; the
    session's tokens are generate's."""
    import threading

    target, draft = llama(), llama(layers=1, seed=2)
    ids = torch.tensor([[5, 6, 7]])
    expected = target.generate(ids, max_new_tokens=12, do_sample=False)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(ids, max_new_tokens=12,
                                                                                  do_sample=False)
    inside, go_on = threading.Event(), threading.Event()

    def hold(module, args, output):
        if not inside.is_set():
            inside.set()
            assert go_on.wait(30)

    errors, streamed = [], []

    def stepper():
        while not session.finished:
            try:
                streamed.extend(session.step()[0])
            except RuntimeError as error:  # (the other thread's step may have finished it meanwhile)
                if not (session.finished and "finished" in str(error)):
                    errors.append(error)
                return

    handle = target.model.layers[0].register_forward_hook(sk.per_token_hook(hold))
    threads = [threading.Thread(target=stepper) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        assert inside.wait(30)
        go_on.set()
        for thread in threads:
            thread.join(60)
    finally:
        go_on.set()
        handle.remove()
    assert not errors
    # (each thread appends its step's tokens after the lock is released: their order between threads is free)
    assert torch.equal(session.sequences(), expected) and sorted(streamed) == sorted(expected[0, 3:].tolist())


def test_session_stats_are_a_snapshot():
    """DecodeSession.stats returned the loop's own object, which later steps updated in place: a value read earlier
    changed under the caller, and 'after - before' came out 0."""
    from helpers.models import llama, perturbed

    target = llama()
    ids = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    session = sk.SpeculativeDecoder(target, perturbed(target, 0.3), num_speculative_tokens=4).start(
        ids, max_new_tokens=30, do_sample=False)
    session.step()
    before = session.stats
    read = before.new_tokens
    emitted = sum(len(tokens) for tokens in session.step())
    after = session.stats
    assert before.new_tokens == read and before is not after
    assert after.new_tokens - before.new_tokens == emitted > 0


def test_a_draft_of_another_vocabulary_is_refused_by_the_constructor():
    """Not accepted and then failing every request at its first step (finish_reason "error")."""
    target, other = llama(vocab=97), llama(vocab=128, seed=1)
    with pytest.raises(ValueError, match="different vocabularies"):
        sk.SpeculativeDecoder(target, other)
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer"):
        sk.SpeculativeDecoder(target, target, tokenizer=object())


def test_a_running_batchs_timer_stays_bounded_as_requests_join():
    """Each joining request's timer is merged into the running loop's, whose prefill phase never stops again: its
    spans were kept one per admission, forever (on CUDA two events each, and every merge copied the list)."""
    from speculative_kernels.generation.stats import PhaseTimer

    running = PhaseTimer(torch.device("cpu"))
    running.start("prefill")
    running.stop("prefill")
    for _ in range(5 * PhaseTimer.FOLD_AT):
        joining = PhaseTimer(torch.device("cpu"))
        joining.start("prefill")
        joining.stop("prefill")
        running.merge(joining)
    assert len(running.spans["prefill"]) < PhaseTimer.FOLD_AT
    assert running.seconds("prefill") >= 0.0
