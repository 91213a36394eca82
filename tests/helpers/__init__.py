"""Shared test helpers: tiny models built from configs, prompts, statistics, host-read counting.

Test files import them as ``from helpers.models import llama`` (``tests/`` is on ``sys.path``, see conftest.py).
"""
