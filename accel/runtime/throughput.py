"""The throughput monitor: samples/s, tokens/s, step time, peak memory and MFU while training.

On with the config's `throughput_monitor: true` (`accel launch --throughput_monitor`), `Accelerator(
throughput_monitor=True)` or a `ThroughputMonitorKwargs(...)` in `kwargs_handlers`; off by default, and then nothing
of it runs: no counting wrapper on the data loaders, no call in `optimizer.step()` (its attribute is None).

Where things are counted, with no synchronisation of the device (no `.item()`, no `cuda.synchronize()`):

* batches: the prepared data loaders hand every batch to `count` before the backend's own per-batch step (sequence
  parallelism's slicing: the whole sequence is counted). Samples are the first dimension of the token tensor (else
  of the batch's first tensor); tokens are the `numel` of `input_ids` (else of the batch's first integer tensor of 2
  or more dimensions), padding included: the tokens the model computes on, which is what MFU divides. Shapes are
  metadata: reading them costs no device work. Batches handed out while the watched model (the first prepared one,
  given to `watch`) is in eval mode are not counted (an evaluation loop's).
* steps: `AcceleratedOptimizer.step()` (the first prepared optimizer's real steps, past the accumulation gate) ticks
  the monitor, which reads `time.perf_counter()`. The first step opens the first window (its time holds compilation
  and warm-up: not measured); every `log_every` steps after it the window is reported and a new one opens. On CUDA
  the host may run ahead of the device by what the launch queue holds; over a window of many steps that is small,
  and the `loss.item()` most loops log already syncs.

Each report (`metrics`, also handed to `log` (the Accelerator's `log`: main process only) at step = optimizer steps so
far):

* `throughput/step_time_s`: seconds per optimizer step over the window;
* `throughput/samples_per_sec`, `throughput/tokens_per_sec`: over all processes (this rank's count x the
  data-parallel degree: ranks that share a batch, tp/pp/sp/cp, count it once);
* `throughput/tokens_per_sec_per_device`: the above / the number of processes;
* `throughput/tflops_per_device`: achieved TFLOP/s per process = FLOPs per token x tokens/s / processes;
* `throughput/mfu_percent`: 100 x achieved / the device's peak FLOP/s (`device_peak`: accel/planning/peak_flops.py's,
  given by the caller);
* `throughput/peak_memory_gb`: this process's peak so far, 1e9 bytes: `torch.cuda.max_memory_allocated` on CUDA,
  the process's peak resident set (getrusage's ru_maxrss) on the CPU.

FLOPs per token: `ThroughputMonitorKwargs(flops_per_token=...)`, else, for a model with a transformers config,
accel's planner's count (accel.planning.plan.training_flops_per_token: 6 x matmul parameters + attention's 12 x
layers x hidden x sequence length, at the window's mean sequence length), else none (tokens/s without MFU). With
no token tensor in the batches, a user's figure is taken per sample.

The monitor is a runtime observer: it knows the loop only by what it is fed (batches, steps, the watched model) and
by what its caller gives it at construction (degrees, device, a `log` sink, and from the planner: `model_flops`,
which counts a model's FLOPs per token, and `device_peak`), so it holds no object of the floors above it.
"""

from __future__ import annotations

import sys
import time
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from accel.config.kwargs import ThroughputMonitorKwargs
    from accel.config.schema import AccelConfig

FlopsPerToken = Callable[[float], float]  # sequence length -> FLOPs of forward + backward per token
Log = Callable[[dict[str, float], int], None]  # (metrics, step) -> None

PREFIX = "throughput/"
STEP_TIME = PREFIX + "step_time_s"
SAMPLES = PREFIX + "samples_per_sec"
TOKENS = PREFIX + "tokens_per_sec"
TOKENS_PER_DEVICE = PREFIX + "tokens_per_sec_per_device"
TFLOPS = PREFIX + "tflops_per_device"
MFU = PREFIX + "mfu_percent"
PEAK_MEMORY = PREFIX + "peak_memory_gb"
KEYS = (STEP_TIME, SAMPLES, TOKENS, TOKENS_PER_DEVICE, TFLOPS, MFU, PEAK_MEMORY)

_UNRESOLVED: Any = object()


def _is_token_tensor(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() >= 2 and not value.is_floating_point()
            and not value.is_complex() and value.dtype is not torch.bool)


def batch_counts(batch: Any) -> tuple[int, int, int]:
    """(samples, tokens, sequence length) of one batch, from tensor shapes only; tokens and length are 0 when the
    batch holds no token tensor (`input_ids`, else its first integer tensor of 2 or more dimensions)."""
    ids = first = None
    if isinstance(batch, torch.Tensor):
        ids, first = (batch if _is_token_tensor(batch) else None), batch
    elif isinstance(batch, Mapping):
        named = batch.get("input_ids")
        tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
        ids = named if isinstance(named, torch.Tensor) else next((v for v in tensors if _is_token_tensor(v)), None)
        first = tensors[0] if tensors else None
    elif isinstance(batch, (list, tuple)):
        tensors = [v for v in batch if isinstance(v, torch.Tensor)]
        ids = next((v for v in tensors if _is_token_tensor(v)), None)
        first = tensors[0] if tensors else None
    if ids is not None:
        if ids.dim() == 0:
            return 1, 1, 1
        samples = ids.shape[0] if ids.dim() >= 2 else 1
        return samples, ids.numel(), ids.shape[-1]
    if first is None:
        return 0, 0, 0
    return (first.shape[0] if first.dim() else 1), 0, 0


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA's max_memory_allocated on a CUDA device, else the peak resident set."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


def status_text(metrics: Mapping[str, float]) -> str:
    """The progress bar's part: `1.23k tok/s, MFU 41.2%, 0.153 s/step` (samples/s when no tokens are counted)."""
    parts = []
    if TOKENS in metrics:
        parts.append(f"{_si(metrics[TOKENS])} tok/s")
    elif SAMPLES in metrics:
        parts.append(f"{_si(metrics[SAMPLES])} samples/s")
    if MFU in metrics:
        parts.append(f"MFU {metrics[MFU]:.1f}%")
    if STEP_TIME in metrics:
        parts.append(f"{metrics[STEP_TIME]:.3g} s/step")
    return ", ".join(parts)


class ThroughputMonitor:
    """Counts batches and optimizer steps of one training loop and reports a window every `log_every` steps.

    `data_parallel_size` and `num_processes` turn this rank's counts into the job's; `log` receives each report;
    `model_flops(model)` is the planner's FLOPs per token of the watched model (None without a transformers config)
    and `device_peak()` the device's peak FLOP/s with the reason when unknown, both asked once, at the first step."""

    def __init__(self, log_every: int = 10, flops_per_token: float | None = None, peak_flops: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, *, data_parallel_size: int = 1,
                 num_processes: int = 1, device: torch.device | None = None, is_main_process: bool = True,
                 log: Log | None = None, model_flops: Callable[[torch.nn.Module], FlopsPerToken | None] | None = None,
                 device_peak: Callable[[], tuple[float | None, str]] | None = None):
        self.log_every = int(log_every)
        self.user_flops_per_token = flops_per_token
        self.user_peak_flops = peak_flops
        self.clock = clock
        self.data_parallel_size = data_parallel_size
        self.num_processes = num_processes
        self.device = device if device is not None else torch.device("cpu")
        self.is_main_process = is_main_process
        self.log = log
        self.model_flops = model_flops
        self.device_peak = device_peak
        self.steps = 0  # optimizer steps seen
        self.metrics: dict[str, float] = {}  # the last report
        self._samples = self._tokens = self._token_seq = 0  # this window's counts (token_seq: tokens x their length)
        self._start: float | None = None  # when the window opened
        self._opened_at = 0  # steps then
        self._model: Callable[[], torch.nn.Module | None] | None = None  # the watched model, weakly
        self._flops: Any = _UNRESOLVED  # the model's FLOPs per token (a function of the length), None when unknown
        self._peak: Any = _UNRESOLVED  # FLOP/s, None when unknown
        from accel.runtime import progress

        progress.show_status(True)

    def watch(self, model: torch.nn.Module | None) -> None:
        """The model whose mode gates counting (eval: not counted) and whose FLOPs are counted: the first prepared
        one (None: none). Held weakly, so a freed model is not kept alive."""
        try:
            self._model = weakref.ref(model) if model is not None else None
        except TypeError:  # an object without weak references: held as it is
            self._model = lambda: model

    # -- the hot path -----------------------------------------------------------------------------------------
    def count(self, batch: Any) -> None:
        """Add one batch to the window (its shapes only); a batch while the watched model is in eval mode is left
        out."""
        model = self._model() if self._model is not None else None
        if model is not None and not model.training:
            return
        samples, tokens, seq = batch_counts(batch)
        self._samples += samples
        self._tokens += tokens
        self._token_seq += tokens * seq

    def counting(self, transform: Callable | None) -> Callable:
        """A data loader's per-batch step: count the batch, then `transform` (the backend's, None: as it is)."""
        def count_then(batch):
            self.count(batch)
            return batch if transform is None else transform(batch)

        count_then.counted_transform = transform  # type: ignore[attr-defined]  # the backend's own, for inspection
        return count_then

    def step(self) -> None:
        """One optimizer step done (called by the prepared optimizer after a real step)."""
        self.steps += 1
        if self._start is None:
            self._resolve()
            self._open()
        elif self.steps - self._opened_at >= self.log_every:
            self.report()

    # -- checkpoints: save_state / load_state (and a fault-tolerant heal) carry the step count ------------------
    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """Go on from the saved step count: the next window opens at the next step, so every logged step is new."""
        self.steps = int(state["steps"])
        self._start = None

    # -- windows ----------------------------------------------------------------------------------------------
    def _open(self) -> None:
        self._samples = self._tokens = self._token_seq = 0
        self._opened_at = self.steps
        self._start = self.clock()

    def _resolve(self) -> None:
        """Once, before the first window opens (so its time is not in a window): the model's FLOPs and the peak."""
        if self._flops is _UNRESOLVED:
            self._flops = None
            model = self._model() if self._model is not None else None
            if self.user_flops_per_token is None and model is not None and self.model_flops is not None:
                try:
                    self._flops = self.model_flops(model)
                except Exception as exc:  # noqa: BLE001 (an odd model: no MFU, never a failed step)
                    warnings.warn(f"throughput monitor: cannot count the model's FLOPs ({exc}); MFU is not reported "
                                  "(give ThroughputMonitorKwargs(flops_per_token=...))", stacklevel=4)
                if self._flops is None and self.is_main_process:
                    warnings.warn("throughput monitor: the model has no transformers config, so its FLOPs per token "
                                  "are unknown and MFU is not reported; give ThroughputMonitorKwargs("
                                  "flops_per_token=...)", stacklevel=4)
        if self._peak is _UNRESOLVED:
            self._peak = self.user_peak_flops
            known = self._flops is not None or self.user_flops_per_token is not None
            if self._peak is None and known and self.device_peak is not None:
                self._peak, why = self.device_peak()
                if self._peak is None and self.is_main_process:
                    warnings.warn(f"throughput monitor: MFU is not reported: {why}", stacklevel=4)

    def flops_per_token(self, seq_len: float) -> float | None:
        """FLOPs of forward + backward per token at sequence length `seq_len`: the user's figure, else the planner's
        count for the model (None without either)."""
        if self.user_flops_per_token is not None:
            return float(self.user_flops_per_token)
        if self._flops is None or self._flops is _UNRESOLVED:
            return None
        return self._flops(seq_len)

    def window_metrics(self, seconds: float, steps: int) -> dict[str, float]:
        """The report of a window of `steps` optimizer steps that took `seconds`, from its counts."""
        shards, world = self.data_parallel_size, self.num_processes
        seconds = max(seconds, 1e-12)
        out = {STEP_TIME: seconds / max(steps, 1)}
        if self._samples:
            out[SAMPLES] = self._samples * shards / seconds
        if self._tokens:
            out[TOKENS] = self._tokens * shards / seconds
            out[TOKENS_PER_DEVICE] = out[TOKENS] / world
        units = self._tokens or (self._samples if self.user_flops_per_token is not None else 0)
        fpt = self.flops_per_token(self._token_seq / self._tokens if self._tokens else 0.0) if units else None
        if fpt:
            achieved = fpt * units * shards / seconds / world
            out[TFLOPS] = achieved / 1e12
            if self._peak:
                out[MFU] = 100.0 * achieved / self._peak
        out[PEAK_MEMORY] = peak_memory_bytes(self.device) / 1e9
        return out

    def report(self) -> dict[str, float]:
        """Close the window: compute its figures, log them, show them in the progress bar, open the next one."""
        assert self._start is not None
        now = self.clock()
        self.metrics = self.window_metrics(now - self._start, self.steps - self._opened_at)
        from accel.runtime import progress

        progress.set_status(status_text(self.metrics))
        if self.log is not None:
            self.log(dict(self.metrics), self.steps)
        self._open()
        return self.metrics

    def close(self) -> None:
        from accel.runtime import progress

        progress.set_status("")


def monitor_for(enabled: bool | None, handler: ThroughputMonitorKwargs | None, config: AccelConfig,
                **wiring: Any) -> ThroughputMonitor | None:
    """The monitor when it is on: `enabled` (the Accelerator argument) when given, else a ThroughputMonitorKwargs
    given or the config's `throughput_monitor`; None when off. `wiring`: ThroughputMonitor's keyword arguments
    (degrees, device, `log`, `model_flops`, `device_peak`)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"Accelerator(throughput_monitor=...): bad value {enabled!r}; allowed: True, False or None "
                        "(None: the config's throughput_monitor; options: ThroughputMonitorKwargs in kwargs_handlers)")
    on = enabled if enabled is not None else (handler is not None or config.throughput_monitor)
    if not on:
        return None
    every = handler.log_every if handler is not None and handler.log_every else config.throughput_log_every
    return ThroughputMonitor(every, getattr(handler, "flops_per_token", None), getattr(handler, "peak_flops", None),
                             **wiring)
