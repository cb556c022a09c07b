"""find_executable_batch_size / should_reduce_batch_size against the real Accelerate (installed by the test extras):
the same sizes tried for the same out-of-memory errors, a real CPU allocation failure counted as one."""

from __future__ import annotations

import pytest
import torch

import accel.utils.memory as ours

real = pytest.importorskip("accelerate.utils.memory")


def _cpu_oom() -> RuntimeError:
    try:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte: the CPU allocator refuses it at once
    except RuntimeError as exc:
        return exc
    pytest.skip("the allocator accepted a petabyte")


@pytest.mark.parametrize("make_error", [lambda: RuntimeError("CPU out of memory."), _cpu_oom,
                                        lambda: RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"),
                                        lambda: torch.OutOfMemoryError("CUDA out of memory.")])
def test_sizes_tried_match_accelerate(make_error):
    tried = {}
    for name, module in (("accel", ours), ("accelerate", real)):
        sizes = tried[name] = []

        @module.find_executable_batch_size(starting_batch_size=30)
        def train(batch_size, text):
            sizes.append(batch_size)
            if batch_size > 20:
                raise make_error()
            return batch_size, text

        assert train("x") == (sizes[-1], "x")
        assert train("y") == (sizes[-1], "y") and sizes.count(sizes[-1]) == 2  # the size found is kept
    assert tried["accel"] == tried["accelerate"], tried


def test_not_oom_and_custom_reduction():
    for error in (ValueError("CPU out of memory."), RuntimeError("some other failure"), RuntimeError("a", "b"),
                  _cpu_oom(), RuntimeError("CPU out of memory.")):
        assert ours.should_reduce_batch_size(error) == real.should_reduce_batch_size(error), error
    sizes = []

    @ours.find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: sizes[-1] - 3)
    def train(batch_size):
        sizes.append(batch_size)
        if batch_size > 2:
            raise RuntimeError("CPU out of memory.")

    train()
    assert sizes == [8, 5, 2]
    with pytest.raises(ValueError, match="Oops"):
        ours.find_executable_batch_size(lambda batch_size: (_ for _ in ()).throw(ValueError("Oops")))()
    with pytest.raises(RuntimeError, match="reached zero"):
        ours.find_executable_batch_size(lambda batch_size: None, starting_batch_size=0)()
    with pytest.raises(TypeError, match="Batch size was passed"):
        ours.find_executable_batch_size(lambda batch_size, a: None)(128, "a")


def test_undo_convert_outputs_pickles():
    """Accelerate's convention: `_original_forward` kept, forward wrapped by convert_outputs_to_fp32; unwrapping with
    keep_fp32_wrapper=False puts the class's forward back (the model pickles, outputs as before)."""
    import pickle

    from accel.utils import convert_outputs_to_fp32, extract_model_from_parallel

    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    expected = model(x)
    model._original_forward = model.forward
    model.forward = convert_outputs_to_fp32(model.forward)
    model = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert "forward" not in model.__dict__ and "_original_forward" not in model.__dict__
    assert torch.equal(pickle.loads(pickle.dumps(model))(x), expected)
