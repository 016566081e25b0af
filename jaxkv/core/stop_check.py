"""Stop conditions checked by the scheduler after each sampled token (vLLM ``check_stop``).

Stop strings are matched by the detokenizer (engine level), not here.
"""

from __future__ import annotations

from jaxkv.core.request import Request, RequestStatus


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


def append_and_check_stop(request: Request, token_ids: list[int], max_model_len: int) -> tuple[list[int], bool]:
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
