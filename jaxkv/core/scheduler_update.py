"""``Scheduler.update_from_output``: a step's results applied to its requests.

Sampled tokens are appended (after rolling back rejected drafts), stop conditions checked,
finished requests freed; the KV connector's report is applied first, and a failed
synchronous load sends its requests back to recompute before their tokens are applied
(``failed_loads``).
"""

from __future__ import annotations

from jaxkv.core.failed_loads import recompute_failed_sync_loads
from jaxkv.core.outputs import EngineCoreOutput, ModelRunnerOutput
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.sched_output import SchedulerOutput
from jaxkv.core.stop_check import append_and_check_stop

_RUNNING = RequestStatus.RUNNING


class SchedulerUpdateMixin:
    """``Scheduler``'s post-step half (it reads and changes its state)."""

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Appends sampled tokens, rolls back rejected drafts, stops and frees finished requests.

        Returns one ``EngineCoreOutput`` per request that got tokens, prompt logprobs or
        finished. Requests finished or aborted since ``schedule()`` are skipped.
        """
        # The step ran: the KV of the blocks its schedule cached is written.
        self._uncommitted = [u for u in self._uncommitted if u[0] is not scheduler_output]
        kv_out = model_runner_output.kv_connector_output
        if kv_out is not None and self.connector is not None:
            self._update_from_kv_xfer(kv_out)
        if self._sync_loads:  # drops the tokens sampled over a failed load's KV
            recompute_failed_sync_loads(
                self, scheduler_output, kv_out.invalid_block_ids if kv_out else set()
            )
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs = model_runner_output.logprobs
        prompt_logprobs_dict = model_runner_output.prompt_logprobs_dict
        pooler_output = model_runner_output.pooler_output
        spec_token_ids = model_runner_output.spec_token_ids
        req_id_to_index = model_runner_output.req_id_to_index
        spec_decode_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests
        update_request = self._update_request_with_output
        outputs: list[EngineCoreOutput] = []
        stopped_ids: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None or request.status != _RUNNING:
                continue
            req_index = req_id_to_index.get(req_id)
            if req_index is None:
                raise ValueError(f"ModelRunnerOutput has no row for scheduled request {req_id!r}")
            generated = sampled_token_ids[req_index]
            scheduled_spec = spec_decode_tokens.get(req_id)
            if scheduled_spec:
                if not generated:
                    raise ValueError(f"request {req_id!r} verified drafts but sampled no token")
                request.num_computed_tokens -= len(scheduled_spec) + 1 - len(generated)
            new_token_ids = generated
            stopped = False
            if generated:
                new_token_ids, stopped = update_request(request, generated)
            new_logprobs = None
            if logprobs is not None and new_token_ids:
                new_logprobs = logprobs[req_index][: len(new_token_ids)]
            prompt_logprobs = prompt_logprobs_dict.get(req_id) if prompt_logprobs_dict else None
            pooled = pooler_output.get(req_id) if pooler_output else None
            if pooled is not None and request.pooling_params is not None:
                request.status = RequestStatus.FINISHED_STOPPED  # pooling ends with its output
                stopped = True
            kv_params = None
            if stopped:
                stopped_ids.add(req_id)
                kv_params = self._free_request(request)
            elif spec_token_ids is not None:
                request.spec_token_ids = list(spec_token_ids[req_index])
            if new_token_ids or stopped or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        finish_reason=request.get_finished_reason(),
                        stop_reason=request.stop_reason,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=prompt_logprobs,
                        num_cached_tokens=request.num_cached_tokens,
                        pooling_output=pooled,
                        kv_transfer_params=kv_params,
                    )
                )
        if stopped_ids:
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
        return outputs

    def _update_request_with_output(
        self, request: Request, generated: list[int]
    ) -> tuple[list[int], bool]:
        """Appends a running request's sampled tokens (``generated``, not empty) and checks
        its stop conditions; returns the tokens it keeps and whether it stopped."""
        if request.num_computed_tokens < request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r} got sampled tokens {generated} for a partial "
                f"prefill chunk ({request.num_computed_tokens}/{request.num_tokens} tokens "
                f"computed)"
            )
        return append_and_check_stop(request, generated, self.max_model_len)
