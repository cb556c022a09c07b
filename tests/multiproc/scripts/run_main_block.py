"""Runs an Accelerate test script whose work is in its `if __name__ == "__main__":` block (no `main()`, e.g.
test_merge_weights.py): the module is imported, its functions wrapped to record, per rank, whether each call passed
(one JSON line per call in OUT/rank{R}.jsonl, as tests/accelerate_compat/run_script.py does for `main()` scripts),
then the block's statements run in the module's namespace. A failing call is recorded and the block goes on.

    python run_main_block.py accelerate.test_utils.scripts.test_merge_weights OUT
"""

import ast
import functools
import importlib
import inspect
import json
import os
import sys
import traceback


def _main_block(module) -> ast.Module:
    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return ast.Module(body=node.body, type_ignores=[])
    raise SystemExit(f"{module.__name__} has no `if __name__ == '__main__':` block")


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a", buffering=1)
    module = importlib.import_module(name)
    depth = [0]

    def record(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if depth[0]:
                return function(*args, **kwargs)  # a helper called by a recorded function
            depth[0] += 1
            entry = {"function": function.__name__}
            try:
                result = function(*args, **kwargs)
                entry["ok"] = True
                return result
            except Exception as exc:  # noqa: BLE001 (the record is the point)
                frames = traceback.extract_tb(exc.__traceback__)
                entry.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                             where=f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "")
                return None
            finally:
                depth[0] -= 1
                log.write(json.dumps(entry) + "\n")

        return wrapper

    for attr, value in list(vars(module).items()):
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            setattr(module, attr, record(value))
    code = compile(_main_block(module), module.__file__, "exec")
    try:
        exec(code, vars(module))
    except Exception as exc:  # noqa: BLE001 (an error outside the recorded calls ends the block)
        log.write(json.dumps({"function": "<main block>", "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
                  + "\n")
        raise
    log.write(json.dumps({"function": "<main finished>", "ok": True}) + "\n")


if __name__ == "__main__":
    main()
