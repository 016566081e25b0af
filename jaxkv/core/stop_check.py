"""Stop conditions checked by the scheduler after each sampled token (vLLM ``check_stop``).

Stop strings are matched by the detokenizer (engine level), not here.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable

from jaxkv.core.request import Request, RequestStatus
from jaxkv.sampling_params import SamplingParams


def merge_eos_token_ids(*sources: int | Iterable[int] | None) -> tuple[int, ...]:
    """Every EOS id of ``sources`` (each None, an id or a sequence of ids), in order, once.

    The engine passes the tokenizer's ``eos_token_id`` then the model config's (an int, or a
    list such as Llama 3's ``[128001, 128008, 128009]``): the first id found is the primary
    EOS (``Request.eos_token_id``), the others are stop token ids (:func:`with_eos_stop_ids`).

    >>> merge_eos_token_ids(None, (128001, 128008, 128009))
    (128001, 128008, 128009)
    >>> merge_eos_token_ids(128009, (128001, 128009))
    (128009, 128001)
    """
    out: dict[int, None] = {}
    for source in sources:
        if source is None:
            continue
        for t in [source] if isinstance(source, numbers.Integral) else source:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"EOS token ids must be ints, got {source!r}")
            if t >= 0:  # a negative id (some GGUF files) means "none"
                out[int(t)] = None
    return tuple(out)


def with_eos_stop_ids(params: SamplingParams, extra_eos_ids: Iterable[int]) -> SamplingParams:
    """``params`` with the EOS ids after the primary one added to its ``stop_token_ids``
    (a copy; ``params`` itself when there is nothing to add), as vLLM adds a generation
    config's EOS ids. Nothing is added with ``ignore_eos``: then no EOS id stops the request,
    and none is banned by ``min_tokens`` (which bans the stop token ids, and the primary EOS
    unless ``ignore_eos``). A request stopped by one of them reports it as ``stop_reason``,
    as in vLLM."""
    missing = [t for t in extra_eos_ids if t not in params.stop_token_ids]
    if params.ignore_eos or not missing:
        return params
    return dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + missing)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Sets a finished status and returns True if ``request`` must stop now.

    Order: length (``num_tokens >= max_model_len`` or ``max_tokens`` outputs), then, once
    ``min_tokens`` outputs exist, EOS (unless ``ignore_eos``), then stop token ids (which
    also set ``stop_reason`` to the token).
    """
    num_output_tokens = request.num_output_tokens
    if request.num_tokens >= max_model_len or num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    params = request.sampling_params
    if num_output_tokens < params.min_tokens:
        return False
    last_token_id = request.output_token_ids[-1]
    if last_token_id == request.eos_token_id and not params.ignore_eos:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if params.stop_token_ids and last_token_id in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    return False


def append_and_check_stop(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], bool]:
    """Appends tokens one by one; at the first stop, drops the rest.

    Returns ``(tokens actually appended, stopped)``.
    """
    appended = []
    for token_id in token_ids:
        token_id = int(token_id)  # numpy ints would hash differently from Python ints
        request.append_output_token_ids(token_id)
        appended.append(token_id)
        if check_stop(request, max_model_len):
            return appended, True
    return appended, False
