"""The wire format between the front end and the engine-core process.

Each message is a zmq multipart ``[MsgType, payload]``. Each step's ``CoreOutputs`` (the hot
path: one message per step holding every running request's new tokens) use msgspec's typed
msgpack; requests (once each) and the start-up reply use pickle, as they carry arbitrary
Python objects (the tokenizer, validated SamplingParams). Measured on the 2-core dev VM,
encode + decode of one step's 64 outputs: msgspec 104 us (10.7 kB), pickle 260 us (5.2 kB);
with 5 logprobs each 177 vs 426 us.
"""

from __future__ import annotations

import enum
import pickle

import msgspec

from jaxkv.core import EngineCoreOutput


class MsgType(bytes, enum.Enum):
    ADD = b"A"  # front -> core: pickle(list[Request]), one request's completions (all or none)
    ABORT = b"X"  # front -> core: pickle((list[str], RequestStatus))
    SHUTDOWN = b"S"  # front -> core
    READY = b"R"  # core -> front: pickle((EngineConfig, ModelConfig, tokenizer, info dict))
    STARTUP_FAILED = b"F"  # core -> front: pickle(str) the error
    OUTPUTS = b"O"  # core -> front: msgspec CoreOutputs


class CoreStats(msgspec.Struct, array_like=True):
    """The scheduler's state after a step (``SchedulerStats``, the prefix-cache interval as counts)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up since start
    prefix_cache_hits: int  # tokens found since start
    prefix_cache_hit_rate: float  # over the recent requests (the scheduler's window)
    num_preemptions: int  # since start
    kv_transfer_bytes: int = 0  # KV connector: bytes loaded from another instance
    kv_transfer_seconds: float = 0.0  # ... and the seconds those loads took (start to data)
    kv_external_tokens: int = 0  # tokens computed elsewhere and loaded
    kv_failed_loads: int = 0  # loads that failed (their requests recomputed)
    num_compiles: int = 0  # programs compiled since start (warm-up included)


class CoreOutputs(msgspec.Struct, array_like=True):
    """One message from the core: a step's outputs, or a failure, with the scheduler's stats."""

    outputs: list[EngineCoreOutput]
    scheduled: list[str] = []  # core ids scheduled in the step
    schedule_time: float = 0.0  # time.perf_counter() of the schedule (CLOCK_MONOTONIC)
    stats: CoreStats | None = None
    failed: list[str] = []  # core ids aborted by a failed step or refused at add
    error: str | None = None  # why


def _enc_hook(obj):
    """numpy arrays (pooled hidden states) as msgpack extension 1: dtype, shape, bytes."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return msgspec.msgpack.Ext(1, pickle.dumps((obj.dtype.str, obj.shape, obj.tobytes())))
    raise NotImplementedError(f"cannot serialise {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview):
    if code == 1:
        import numpy as np

        dtype, shape, raw = pickle.loads(data)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    raise NotImplementedError(f"unknown msgpack extension {code}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(CoreOutputs, ext_hook=_ext_hook)


def encode_core_outputs(msg: CoreOutputs) -> bytes:
    """``msg`` as typed msgpack (the payload of an ``OUTPUTS`` message)."""
    return _ENCODER.encode(msg)


def decode_core_outputs(payload) -> CoreOutputs:
    """An ``OUTPUTS`` payload (bytes or a buffer) back as ``CoreOutputs``."""
    return _DECODER.decode(payload)
