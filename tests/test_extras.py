"""Optional extras: the core imports none of them, every package leanml imports is declared, and a command
whose extra is missing stops with one line naming ``pip install 'leanml[extra]'`` (simulated by putting None in
``sys.modules``, which makes an import fail as an uninstalled package does)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import leanml
from cli.conftest import CliResult, assert_user_error, cli_env, save_tiny_llama
from leanml import extras
from leanml.errors import LeanmlError
from leanml.extras import EXTRAS, MissingExtraError, missing_extra, require_extra

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "leanml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: the packages of the core install: pruning, evaluation, training (no extra may be needed to import them)
CORE_PACKAGES = ("leanml.prune", "leanml.eval", "leanml.models", "leanml.data", "leanml.memory", "leanml.recover")


def _dist_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level name of every module leanml imports that is neither leanml's nor the standard library's
    -> the files importing it."""
    found: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "leanml" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared_and_extras_name_what_they_install() -> None:
    core = {_dist_name(r) for r in PYPROJECT["project"]["dependencies"]}
    optional = {extra: {_dist_name(r) for r in reqs}
                for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()}
    dists = importlib.metadata.packages_distributions()
    # huggingface_hub comes with transformers and is only probed (models/check.py guards its import)
    allowed_transitive = {"huggingface_hub": "transformers"}
    for module, files in _third_party_imports().items():
        if module in allowed_transitive:
            continue
        owners = {d.lower().replace("_", "-") for d in dists.get(module, [])}
        assert owners, f"{module} (imported by {sorted(files)}) is not installed here"
        declared_core = owners & core
        extras_of = {e for e, reqs in optional.items() if owners & reqs}
        assert declared_core or extras_of, f"{module} ({sorted(files)}) is in no dependency of pyproject.toml"
        if not declared_core:  # an extra's package: the helper names an extra that installs it
            assert extras.extra_of(module) in extras_of, module
    for extra, modules in EXTRAS.items():  # and every module the helper attributes to an extra comes with it
        for module in modules:
            owners = {d.lower().replace("_", "-") for d in dists.get(module, [])}
            assert owners & optional[extra], f"{module} is not installed by leanml[{extra}]"
    # no exact pin except the eval harness (its task format changes between releases)
    pinned = [r for reqs in [PYPROJECT["project"]["dependencies"], *PYPROJECT["project"]["optional-dependencies"]
                             .values()] for r in reqs if "==" in r]
    assert pinned == ["lm-eval==0.4.13"]
    everything = PYPROJECT["project"]["optional-dependencies"]["all"]
    assert [r.split("[")[1].rstrip("]").split(",") for r in everything] == [
        [e for e in PYPROJECT["project"]["optional-dependencies"] if e not in ("all", "dev")]]


def test_require_extra_returns_the_module_or_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    assert require_extra("features", "json") is json  # any importable module comes back as is
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingExtraError) as err:
        require_extra("features", "pyarrow", command="features")
    message = str(err.value)
    assert message == ("leanml features needs the 'features' extra (pyarrow is not installed); "
                       "install it with: pip install 'leanml[features]'")
    assert isinstance(err.value, LeanmlError) and isinstance(err.value, ModuleNotFoundError)
    with pytest.raises(ValueError, match="unknown extra"):
        require_extra("nosuch", "json")


def test_missing_extra_names_the_commands_own_extra_first() -> None:
    exc = ModuleNotFoundError("No module named 'pandas'", name="pandas")
    assert "leanml[ctr]" in str(missing_extra(exc, "ctr"))
    assert "leanml[features]" in str(missing_extra(exc, "features"))
    assert "leanml[features]" in str(missing_extra(exc))  # no command: the first extra that brings it
    assert "leanml[gguf]" in str(missing_extra(ModuleNotFoundError("x", name="gguf.quants"), "prune"))
    assert missing_extra(ModuleNotFoundError("x", name="torch"), "prune") is None  # a core package: a bug
    assert missing_extra(ModuleNotFoundError("x", name="nosuchpkg")) is None


def _run_blocked(blocked: list[str], code: str, cwd: Path) -> CliResult:
    """Run ``code`` in a fresh interpreter where each module in ``blocked`` fails to import."""
    prelude = f"import sys\nfor _m in {blocked!r}:\n    sys.modules[_m] = None\n"
    proc = subprocess.run([sys.executable, "-c", prelude + code], cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


#: what the extras bring and the core does not (pyyaml comes with transformers and huggingface_hub anyway)
ALL_EXTRA_MODULES = sorted({m for extra, mods in EXTRAS.items() if extra != "dev" for m in mods} - {"yaml"})


def test_the_core_imports_no_extra(tmp_path: Path) -> None:
    """Every module of the core packages, the command line and its help import with every extra missing."""
    code = ("import importlib, pkgutil\n"
            "from leanml import cli\n"
            "cli.build_parser()\n"
            f"for pkg in {CORE_PACKAGES!r}:\n"
            "    mod = importlib.import_module(pkg)\n"
            "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
            "        importlib.import_module(info.name)\n"
            "        print(info.name)\n")
    result = _run_blocked(ALL_EXTRA_MODULES, code, tmp_path)
    assert result.code == 0, str(result)
    assert "leanml.prune.engine" in result.stdout.split() and "leanml.memory.milp" in result.stdout.split()


@pytest.mark.parametrize("blocked, args, needles", [
    # the subsystem cannot even be imported: its command is still listed and refuses every argument
    (["pyarrow"], ["features", "train", "--graph", "movielens"], ["leanml features", "pip install 'leanml[features]'"]),
    (["pyarrow"], ["features", "--help"], ["pip install 'leanml[features]'"]),
    # imported when the command runs: caught by the command line, named with the command's own extra
    (["pandas"], ["ctr", "train", "--model", "lr", "--out", "out"], ["leanml ctr", "pip install 'leanml[ctr]'"]),
    # the hub corpora need datasets
    (["datasets"], ["eval", "--model", "model", "--data", "wikitext2", "--seqlen", "32"],
     ["pip install 'leanml[hub]'"]),
])
def test_a_command_without_its_extra_fails_in_one_line(tmp_path: Path, blocked: list[str], args: list[str],
                                                       needles: list[str]) -> None:
    save_tiny_llama(tmp_path / "model")
    result = _run_blocked(blocked, f"from leanml.cli import main\nsys.exit(main({args!r}))", tmp_path)
    assert_user_error(result, *needles)
    assert not (tmp_path / "out").exists()


def test_help_lists_a_command_whose_extra_is_missing(tmp_path: Path) -> None:
    result = _run_blocked(["pyarrow"], "from leanml.cli import main\nsys.exit(main(['--help']))", tmp_path)
    assert result.code == 0, str(result)
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("features"))
    assert "pip install 'leanml[features]'" in line


def test_version_prints_the_versions_and_the_device(tmp_path: Path) -> None:
    import torch
    import transformers

    proc = subprocess.run([sys.executable, "-m", "leanml", "--version"], cwd=tmp_path, env=cli_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["leanml"] == leanml.__version__ == importlib.metadata.version("leanml")
    assert lines["torch"] == torch.__version__ and lines["transformers"] == transformers.__version__
    assert lines["device"] == "cpu" if not torch.cuda.is_available() else lines["device"].startswith("cuda (")


@pytest.mark.parametrize("package, old, floor", [("torch", "2.5.1", "2.6"), ("transformers", "4.57.6", "5.0")])
def test_an_old_torch_or_transformers_is_refused_in_one_line(tmp_path: Path, package: str, old: str,
                                                             floor: str) -> None:
    """Before any work, even before the subcommands are imported: one line naming the pip command."""
    code = ("import importlib.metadata as md\n"
            "real = md.version\n"
            f"md.version = lambda name: {old!r} if name == {package!r} else real(name)\n"
            "sys.argv = ['leanml', 'prune', '--help']\n"
            "import leanml.cli\n"
            "print('imported')\n")
    result = _run_blocked([], code, tmp_path)
    line = assert_user_error(result, f"{package} >= {floor}", f"found {package} {old}",
                             f"pip install '{package}>={floor}'")
    assert "imported" not in result.stdout, line


def test_library_import_of_an_old_transformers_raises() -> None:
    with pytest.raises(leanml.TorchVersionError, match=r"needs transformers >= 5\.0, found transformers 4\.57\.6"):
        leanml.check_transformers_version("4.57.6")
    for ok in ("5.0.0", "5.25.0", None, "dev"):
        leanml.check_transformers_version(ok)
