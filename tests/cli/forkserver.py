"""A process that has imported ``leanml`` once and forks a child per command: each child runs the real
``leanml.cli.main`` with its own working directory, environment, stdout and stderr files and exit code,
so a command costs milliseconds to start instead of the ~3 s of a fresh Python importing torch.

Protocol (one JSON object per line): the test sends ``{"args", "cwd", "env", "out", "err"}``; the
server forks, answers ``{"pid": ...}``, waits, and answers ``{"code": ...}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _child(req: dict) -> None:
    code = 1
    try:
        os.chdir(req["cwd"])
        os.environ.update(req["env"])
        for fd, path in ((1, req["out"]), (2, req["err"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.stdout = open(1, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        sys.argv = ["leanml", *req["args"]]
        from leanml.cli import main

        try:
            code = main(req["args"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - shown to the test like a real interpreter would
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code if isinstance(code, int) else 1)


#: modules most commands import before they fail or finish (imported once here, not in every child)
PRELOAD = ("leanml.data.text", "leanml.models", "leanml.models.check", "leanml.models.layout",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "leanml.prune.engine", "leanml.recover.api", "leanml.train", "datasets", "pyarrow.parquet")


def serve() -> None:
    import importlib

    import leanml.cli

    leanml.cli.build_parser()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"code": code}), flush=True)


if __name__ == "__main__":
    serve()
