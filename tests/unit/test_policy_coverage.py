"""Every RPC of every service has an access rule, and every rule names an RPC that exists.

The RPCs are read from the generated descriptors (every `_pb2` module under
`gen/agentim`, plus gRPC health), so a new RPC without a rule fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

import agentim
from services.common.authn import Policy
from services.im.entrypoints.policy import IM_POLICY
from services.memory.entrypoints.policy import MEMORY_POLICY
from services.runtime.entrypoints.policy import RUNTIME_POLICY

# The package each policy serves (the services are named agentim.<package>.v1.*).
POLICIES = {"im": IM_POLICY, "runtime": RUNTIME_POLICY, "memory": MEMORY_POLICY}


def _methods_of(module: object) -> dict[str, list[str]]:
    """Full method names by service, of one generated module."""
    descriptor = module.DESCRIPTOR  # type: ignore[attr-defined]
    return {
        service.full_name: [f"/{service.full_name}/{method.name}" for method in service.methods]
        for service in descriptor.services_by_name.values()
    }


def _generated_rpcs() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    root = Path(agentim.__path__[0])
    for info in pkgutil.walk_packages([str(root)], prefix="agentim."):
        if info.name.endswith("_pb2"):
            found.update(_methods_of(importlib.import_module(info.name)))
    return found


RPCS = _generated_rpcs()


def _policy_of(service: str) -> Policy:
    package = service.split(".")[1]
    assert package in POLICIES, f"no policy table for the services of agentim.{package}"
    return POLICIES[package]


def test_the_descriptors_were_found() -> None:
    assert {s.rsplit(".", 1)[-1] for s in RPCS} >= {
        "IMService",
        "AuthService",
        "RuntimeService",
        "MemoryService",
    }


@pytest.mark.parametrize("service", sorted(RPCS))
def test_every_rpc_has_a_rule(service: str) -> None:
    policy = _policy_of(service)
    missing = [method for method in RPCS[service] if policy.rule_for(method) is None]
    assert not missing, f"no access rule for {missing}"


@pytest.mark.parametrize("package", sorted(POLICIES))
def test_every_rule_names_an_rpc_that_exists(package: str) -> None:
    served = {m for service, methods in RPCS.items() if service.split(".")[1] == package for m in methods}
    unknown = sorted(set(POLICIES[package]) - served)
    assert not unknown, f"rules for RPCs that do not exist: {unknown}"


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_health_is_public_in_every_service(policy: Policy) -> None:
    for service in health_pb2.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            rule = policy.rule_for(f"/{service.full_name}/{method.name}")
            assert rule is not None and rule.public
