"""Accelerate's module name for the collective operations (`from accelerate.utils.operations import ...`)."""

from accel.ops import (  # noqa: F401
    DistributedOperationException,
    broadcast,
    broadcast_object_list,
    TensorInformation,
    concatenate,
    copy_tensor_to_devices,
    gather,
    find_batch_size,
    gather_object,
    get_data_structure,
    initialize_tensors,
    is_tensor_like,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
)
