"""Accelerate's `tqdm`: a progress bar shown on the main process only (by default); needs the tqdm package."""

from __future__ import annotations


def tqdm(*args, main_process_only: bool = True, **kwargs):
    try:
        from tqdm.auto import tqdm as _tqdm
    except ImportError:
        raise ImportError("accel.utils.tqdm needs the tqdm package: pip install tqdm") from None
    if args and isinstance(args[0], bool):  # Accelerate's old positional form: tqdm(main_process_only, iterable)
        main_process_only, args = args[0], args[1:]
    from accel.state import PartialState

    state = PartialState._instance
    if main_process_only and state is not None and state.initialized:
        kwargs["disable"] = kwargs.get("disable", False) or not state.is_local_main_process
    return _tqdm(*args, **kwargs)
