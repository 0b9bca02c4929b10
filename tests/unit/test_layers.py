"""The layers of STYLE.md, checked on the import graph: a service's domain
(and the error categories every service shares) is pure, so it imports none of
the I/O libraries, directly or through another module of ours."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IO_LIBRARIES = frozenset(
    {"grpc", "grpc_status", "sqlalchemy", "asyncpg", "aiosqlite", "redis", "openai", "aiohttp"}
)


def module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imports_of(module: str) -> set[str]:
    path = module_path(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.add(name)
            found.update(
                f"{name}.{alias.name}" for alias in node.names if module_path(f"{name}.{alias.name}")
            )
    return found


def io_reached_from(start: str) -> dict[str, list[str]]:
    """Each I/O library reachable from `start`, with the chain of our modules that leads to it."""
    reached: dict[str, list[str]] = {}
    seen = {start}
    chains = [[start]]
    while chains:
        chain = chains.pop()
        for imported in imports_of(chain[-1]):
            top = imported.split(".")[0]
            if top in IO_LIBRARIES:
                reached.setdefault(top, chain)
            elif top in {"services", "gateway"} and imported not in seen and module_path(imported):
                seen.add(imported)
                chains.append([*chain, imported])
    return reached


PURE_MODULES = sorted(
    {"services.common.errors", "services.common.status"}
    | {
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for service in ("im", "runtime", "memory")
        for path in (ROOT / "services" / service / "domain").glob("*.py")
        if path.name != "__init__.py"
    }
)


def test_the_domains_are_found() -> None:
    assert {"services.im.domain.errors", "services.runtime.domain.model"} <= set(PURE_MODULES)


@pytest.mark.parametrize("module", PURE_MODULES)
def test_a_domain_module_imports_no_io_library(module: str) -> None:
    assert io_reached_from(module) == {}


def test_the_check_follows_imports_through_our_modules() -> None:
    # The IM's bootstrap wires adapters: it reaches grpc_status only through
    # the shared server and its interceptors.
    reached = io_reached_from("services.im.bootstrap")
    assert reached["grpc_status"][0] == "services.im.bootstrap"
    assert "services.common.interceptors" in reached["grpc_status"]
