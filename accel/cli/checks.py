"""What `accel launch` (and `accel env`) check before anything starts, and what `accel launch --dry_run` prints.

Each check raises UsageError/ConfigError, which `accel` prints as one line with exit code 2.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import logging
import os
import shlex
import sys
import warnings
from pathlib import Path

from accel.cli._common import UsageError
from accel.config import (
    DEEPSPEED_FILE_KEY,
    PACKAGED_DEFAULT,
    AccelConfig,
    ConfigError,
    LAUNCH_ENV,
    DeepSpeedConfigWarning,
    encode_for_workers,
    parse_layer,
    read_config_file,
    read_deepspeed_config,
    resolve_launch_config,
    user_config_path,
)
from accel.config.accelerate_import import deepspeed_path
from accel.config.degrees import data_parallel_sizes, layout_words
from accel.config.kwargs import process_group_backend
from accel.config.schema import SECTIONS
from accel.backends.launchable import check_launchable

# -------------------------------------------------------------------------------------------------------
# the config
# -------------------------------------------------------------------------------------------------------


# flags whose empty value is a mistake, not "the default" (a variable that expanded to nothing: `--log_dir $LOGS`):
# flag -> what is allowed. (--include/--exclude '' are DeepSpeed's own defaults, no filter; the config keys' flags
# refuse '' with their allowed values.)
NON_EMPTY_FLAGS = {
    "config_file": "the path of a config file (leave the flag out for the default one)",
    "deepspeed_config_file": "the path of a DeepSpeed JSON file",
    "hostfile": "the path of a hostfile (leave the flag out to run on this machine)",
    "deepspeed_hostfile": "the path of a hostfile (leave the flag out to run on this machine)",
    "log_dir": "a folder (leave the flag out for no log files)",
    "ssh_command": "a command line such as 'ssh -p 2222' (leave the flag out for $ACCEL_SSH_COMMAND, else 'ssh -o "
                   "BatchMode=yes')",
}


def check_flag_conflicts(args) -> None:
    """Flags that contradict each other, or given empty (`accel launch` and `accel env` take the same ones)."""
    if args.cpu and args.multi_gpu:
        raise UsageError("--cpu and --multi_gpu contradict each other; give one of them")
    for name, allowed in NON_EMPTY_FLAGS.items():
        value = getattr(args, name, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{name} {value!r}: empty; allowed: {allowed}")


def config_source(config_file: str | None, overrides: dict, flags_source: str) -> str:
    """How errors name the resolved config: the user's file (or the packaged default), plus the flags if any."""
    source = str(user_config_path(config_file) or PACKAGED_DEFAULT)
    return f"{source} + {flags_source}" if overrides else source


_held: list[str] = []  # warning lines held back until every check passed (release_warnings)


def resolve_checked(config_file: str | None, overrides: dict, prog: str, flags_source: str,
                    hold_warnings: bool = False) -> AccelConfig:
    """The config a launch would run with, through `check_launchable` (the rules `accel launch`, `accel env` and
    `accel config` share). A DeepSpeed JSON's ignored keys are one warning line each, like our errors, printed once the
    config passed; with `hold_warnings` only at `release_warnings()` (after the caller's own checks: a refusal stays
    the one line)."""
    _held.clear()  # an earlier refused command's (accel run in one process, as by tests)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeepSpeedConfigWarning)
        cfg = resolve_launch_config(config_file, overrides, flags_source)
    cfg = check_launchable(cfg, config_source(config_file, overrides, flags_source))
    check_worker_env_size(cfg)
    for warning in caught:  # only for a config that passed: an error is the one line
        if issubclass(warning.category, DeepSpeedConfigWarning):
            _held.append(f"{prog}: warning: {' '.join(str(warning.message).split())}\n")  # one line each
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if not hold_warnings:
        release_warnings()
    return cfg


def release_warnings() -> None:
    """Print the warning lines `resolve_checked` held back."""
    sys.stderr.writelines(_held)
    sys.stderr.flush()
    _held.clear()


# Linux's limit for one environment variable ("NAME=value", MAX_ARG_STRLEN): a longer ACCEL_LAUNCH_CONFIG (a huge
# DeepSpeed JSON, a string of megabytes in a config file) would make starting the workers fail (E2BIG)
ENV_VALUE_MAX = 128 * 1024 - 1


def check_worker_env_size(cfg: AccelConfig) -> None:
    """The resolved config must fit in the one variable that carries it to the workers."""
    size = len(LAUNCH_ENV) + 1 + len(encode_for_workers(cfg).encode())
    if size > ENV_VALUE_MAX:
        carried = f" (with the DeepSpeed JSON {cfg.deepspeed_json_path})" if cfg.deepspeed_json_path else ""
        raise ConfigError(f"the resolved config{carried} is {size} bytes as JSON, too long for the one environment "
                          f"variable ({LAUNCH_ENV}) that carries it to the workers; allowed: up to {ENV_VALUE_MAX} "
                          "bytes (shorten its longest values)")


# -------------------------------------------------------------------------------------------------------
# torchrun
# -------------------------------------------------------------------------------------------------------

def check_torchrun_argv(argv: list[str]) -> None:
    """What torchrun itself would refuse in `argv` (its argument parser, then the checks of its launch config),
    refused now as one UsageError, before any process starts: `accel launch` and its --dry_run check the same.
    Nothing is started; torchrun's warnings and its OMP_NUM_THREADS default are not kept."""
    from torch.distributed import run as torchrun

    said = io.StringIO()
    threads = os.environ.get("OMP_NUM_THREADS")  # config_from_args sets it when unset
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)  # its notes (the OMP_NUM_THREADS banner) belong to a real launch
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            torchrun.config_from_args(torchrun.parse_args(list(argv)))
    except SystemExit:  # its argument parser: usage, then `torchrun: error: ...` as the last line
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        message = lines[-1].split("error: ", 1)[-1] if lines else "bad arguments"  # without its `prog: error:`
        raise UsageError(f"torchrun refused its arguments: {message}") from None
    except (ValueError, AssertionError, TypeError, KeyError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise UsageError(f"torchrun refused its arguments: {message}") from None
    finally:
        logging.disable(quiet)
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads


# -------------------------------------------------------------------------------------------------------
# the script or module
# -------------------------------------------------------------------------------------------------------

def check_script(script: str) -> None:
    """`script` must be something `python script` runs: a readable file, or a folder/zip with __main__.py; and its
    Python must compile (`check_compiles`)."""
    path = Path(script)
    if not os.path.exists(script):  # (os.path's: False for a path the OS refuses, as too long)
        raise UsageError(f"script not found: {script} (relative to {os.getcwd()}); allowed: the path of a Python "
                         "file, or -m for a module")
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise UsageError(f"script {script} is a directory without __main__.py; allowed: a Python file, or -m "
                             "for a module")
        check_compiles(str(path / "__main__.py"))
        return
    if not os.access(path, os.R_OK):
        raise UsageError(f"script {script} cannot be read (permission denied)")
    check_compiles(script)


COMPILE_CHECK_BYTES = 64 << 20  # a larger script is left to `python` (compiling it here would cost its time again)


def check_compiles(script: str) -> None:
    """A script that does not compile (a SyntaxError, an IndentationError, a bad encoding, a null byte) is refused in
    one line naming the file and the line, before any process starts: every worker would fail the same way. Compiled
    as `python` does (bytes, so its coding declaration holds); not run. What is not a regular file of at most
    COMPILE_CHECK_BYTES (a FIFO, a device: read without blocking, checked on the descriptor read), a zip application or
    a bytecode file (which `python` also runs) is left to `python`."""
    import importlib.util
    import stat
    import zipfile

    try:
        fd = os.open(script, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UsageError(f"script {script} cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > COMPILE_CHECK_BYTES:
            return
        source = fh.read(COMPILE_CHECK_BYTES + 1)
    if source[:4] == importlib.util.MAGIC_NUMBER or zipfile.is_zipfile(io.BytesIO(source)):
        return
    try:
        compile(source, script, "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError and TabError too
        where = f"{exc.filename or script}:{exc.lineno}" if exc.lineno else (exc.filename or script)
        message = " ".join(str(exc.msg).split()) or "invalid syntax"
        raise UsageError(f"{where}: {type(exc).__name__}: {message}") from None
    except ValueError as exc:  # a null byte (Python before 3.12)
        raise UsageError(f"{script}: SyntaxError: {' '.join(str(exc).split())}") from None


def worker_search_path(extra: list[str] | None = None) -> list[str]:
    """Where `python -m` in a worker looks: its current directory first, then PYTHONPATH, then the rest."""
    entries = [os.getcwd(), *(extra or []), *os.environ.get("PYTHONPATH", "").split(os.pathsep), *sys.path]
    return [entry or os.getcwd() for entry in entries]


def check_module(name: str, extra_path: list[str] | None = None) -> None:
    """`name` must be a module `python -m name` finds from here, found without importing it (its parent packages'
    `__init__` are not run either)."""
    search = worker_search_path(extra_path)
    found = _find_module(name, search)
    if found is None:
        if name.endswith(".py") and os.path.isfile(name):
            raise UsageError(f"module not found: {name} is a file, and -m takes a module name; allowed: the file "
                             f"without -m (accel launch {name}), or -m {name[:-3].replace(os.sep, '.')}")
        raise UsageError(f"module not found: {name} (-m looks in the current directory {os.getcwd()}, PYTHONPATH "
                         "and the installed packages); allowed: an importable module such as my_pkg.train")
    if found.submodule_search_locations is not None and _find_module(f"{name}.__main__", search) is None:
        raise UsageError(f"module {name} is a package without __main__.py, so it cannot be run with -m; allowed: "
                         f"one of its modules ({name}.<module>)")


def _find_module(name: str, search: list[str]):
    """The module spec of `name` or None, looking through `search` and the installed finders; nothing is imported."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return None
    spec = importlib.machinery.PathFinder.find_spec(parts[0], search) or _meta_path_spec(parts[0], None)
    for depth in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = _meta_path_spec(".".join(parts[:depth + 1]), list(spec.submodule_search_locations))
    return spec


def _meta_path_spec(fullname: str, path: list[str] | None):
    """What `sys.meta_path`'s finders (builtins, the path, editable installs' own finders) find for `fullname`."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            spec = find_spec(fullname, path)
        except Exception:  # a third-party finder's own trouble is not the user's mistake
            continue
        if spec is not None:
            return spec
    return None


# -------------------------------------------------------------------------------------------------------
# accel launch --dry_run
# -------------------------------------------------------------------------------------------------------

def value_sources(config_file: str | None, overrides: dict, flags_source: str) -> dict[str, tuple[str, object]]:
    """For each dotted key some layer sets: (the layer that won, the value it gave). The files are read again
    (they were just read without error); the precedence is `accel.config.resolve`'s."""
    layers = [("packaged default", read_config_file(PACKAGED_DEFAULT))]
    user = user_config_path(config_file)
    if user is not None:
        layers.append((str(user), read_config_file(user)))
    overrides = dict(overrides)
    ds_path = deepspeed_path(overrides.pop(DEEPSPEED_FILE_KEY, None), DEEPSPEED_FILE_KEY, flags_source, None)
    if ds_path is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeepSpeedConfigWarning)  # already shown once
            layers.append((str(ds_path), read_deepspeed_config(ds_path)))
    if overrides:
        layers.append((flags_source, parse_layer(overrides, flags_source)))
    sources: dict = {}
    for name, layer in layers:
        for key, value in _flat(layer).items():
            sources.pop(key, None)  # in the order of the layers that won: lowest first
            sources[key] = (name, value)
    return sources


def _flat(data: dict) -> dict:
    """A config's keys, those of its sections (parallelism, fault_tolerance) dotted."""
    out: dict = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            out.update({f"{key}.{sub}": v for sub, v in value.items()})
        else:
            out[key] = value
    return out


def _yaml_value(value: object) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10**6)
    return text.removesuffix("\n...\n").rstrip("\n")


def value_notes(cfg: AccelConfig, sources: dict[str, tuple[str, object]]) -> dict[str, tuple[object, str]]:
    """Each key of the config's file form (dotted in its sections) -> (its value, where it came from): a file, the
    flags, `default` (accel's built-in value) or `derived` (computed from other keys)."""
    import yaml

    builtin = _flat(AccelConfig().to_dict())
    notes = {}
    for key, value in _flat(yaml.safe_load(cfg.to_yaml())).items():  # the config-file form (what a file could say)
        if key in sources:
            name, given = sources[key]
            notes[key] = (value, name if given == value else "derived")
        else:
            notes[key] = (value, "default" if builtin.get(key) == value else "derived")
    return notes


def annotated_yaml(cfg: AccelConfig, sources: dict[str, tuple[str, object]]) -> list[str]:
    """The config as YAML, one key per line, each followed by `# <where it came from>` (`value_notes`)."""
    lines = []
    for key, (value, note) in value_notes(cfg, sources).items():
        section, _, name = key.rpartition(".")
        if section and f"{section}:" not in lines:
            lines.append(f"{section}:")
        lines.append(f"{'  ' if section else ''}{name}: {_yaml_value(value)}  # {note}")
    return lines


def set_by(cfg: AccelConfig, sources: dict[str, tuple[str, object]]) -> str:
    """The values that are not accel's built-in ones, after the file (or flags) that set each: `path: key value, ...;
    flags: ...`; "" when there are none."""
    builtin = _flat(AccelConfig().to_dict())
    notes = value_notes(cfg, sources)
    layers: dict[str, list[str]] = {}
    for key in sources:  # the layers in precedence order, lowest first
        value, note = notes.get(key, (None, "derived"))
        if note not in ("default", "derived") and value != builtin.get(key):
            layers.setdefault(note, []).append(f"{key.rpartition('.')[2]} {_yaml_value(value)}")
    return "; ".join(f"{name}: {', '.join(items)}" for name, items in layers.items())


def layout(cfg: AccelConfig) -> str:
    """What the run is, in words: processes, distributed type and process-group backend, the parallel layout, mixed
    precision and gradient accumulation."""
    par = cfg.parallelism
    dist_type = cfg.resolved_distributed_type()  # as the launcher filled it in (else derived as it would be)
    device = "cuda" if dist_type == "MULTI_GPU" else "cpu"
    backend = "" if dist_type == "NO" else ", " + process_group_backend(
        None, device, par.offload_params or par.offload_optimizer)
    processes = f"{cfg.num_processes} process{'es' if cfg.num_processes > 1 else ''}"
    if cfg.num_machines > 1:
        processes += f" on {cfg.num_machines} machines"
    groups = f", fault tolerance over {cfg.fault_tolerance.group_size} replica groups" if (
        cfg.fault_tolerance.enabled and cfg.fault_tolerance.replica_id is None) else ""
    words = layout_words(par, *data_parallel_sizes(par, cfg.num_processes))
    return (f"{processes} ({dist_type}{backend}){groups}, {words}, mixed precision {cfg.mixed_precision}, gradient "
            f"accumulation {cfg.gradient_accumulation_steps}")


def start_line(cfg: AccelConfig, sources: dict[str, tuple[str, object]], note: str = "") -> str:
    """`accel launch`'s first line: what runs (`layout`), where each value not accel's own default came from, then
    `note` (shim.py's when the launcher turned the shim on by itself)."""
    where = set_by(cfg, sources)
    return f"accel launch: {layout(cfg)}" + (f" (set by {where})" if where else "") + (f"; {note}" if note else "")


def print_dry_run(cfg: AccelConfig, sources: dict, env: dict[str, str], command: list[str]) -> int:
    """What `accel launch --dry_run` prints (on stdout): the resolved config and the exact command; starts nothing."""
    out = ["# accel launch --dry_run: nothing was started", "# resolved config (after '#': where each value came from)"]
    out += annotated_yaml(cfg, sources)
    out.append("# the command accel launch runs, with the variables it adds to the environment:")
    out.append(" ".join([*(f"{name}={shlex.quote(value)}" for name, value in env.items()), shlex.join(command)]))
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def dry_run_sources(config_file: str | None, overrides: dict, flags_source: str) -> dict:
    """`value_sources`, or none when a file cannot be read a second time (the dry run still prints the config)."""
    try:
        return value_sources(config_file, overrides, flags_source)
    except (ConfigError, OSError):
        return {}
