"""The scheduler for async scheduling (vLLM V1's ``AsyncScheduler``).

With ``async_scheduling`` the engine calls ``schedule()`` for step N+1 before
``update_from_output`` of step N: a request whose scheduled tokens reach its end will sample
one token, counted in ``num_output_placeholders`` until it arrives, so the next schedule
gives it that token's slot; a request whose token in flight is its ``max_tokens``-th is not
scheduled again (the running phase skips it). A token that arrives for a request preempted
or finished in between is dropped (it was never output; recompute samples it again).

The engine core builds one when its settings have ``async_scheduling=True``; ``Scheduler``
refuses such settings.
"""

from __future__ import annotations

from jaxkv.core.request import Request
from jaxkv.core.sched_output import SchedulerOutput
from jaxkv.core.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """``Scheduler`` whose requests count the tokens their steps in flight will sample.

    Same arguments as ``Scheduler``; the settings must have ``async_scheduling=True``.
    """

    supports_async_scheduling = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.scheduler_config.async_scheduling:
            raise ValueError("AsyncScheduler needs a SchedulerConfig with async_scheduling=True")

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        super()._update_after_schedule(scheduler_output)
        requests = self.requests
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests[req_id]
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token

    def _update_request_with_output(
        self, request: Request, generated: list[int]
    ) -> tuple[list[int], bool]:
        if request.num_output_placeholders:  # the tokens in flight have arrived
            request.num_output_placeholders = max(
                0, request.num_output_placeholders - len(generated)
            )
        return super()._update_request_with_output(request, generated)
