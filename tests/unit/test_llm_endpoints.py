"""Which hosts an agent's model.base_url may name (services/runtime/domain/endpoints.py),
and the guard that resolves names, when set and before each request."""

from __future__ import annotations

import pytest

from services.runtime.domain.endpoints import AllowedHosts, endpoint_of
from services.runtime.domain.errors import EndpointNotAllowed, EndpointRefused, LLMRejected
from services.runtime.domain.llm import CompletionRequest, ModelSettings
from services.runtime.service_layer.endpoint_guard import EndpointGuard
from services.runtime.service_layer.llm_router import ModelRouter
from tests.unit.runtime_fakes import ScriptedLLM


def judge(allowed: AllowedHosts, url: str, addresses: list[str] | None = None) -> str:
    try:
        endpoint = endpoint_of(url)
        allowed.check_host(endpoint)
        allowed.check_addresses(endpoint, addresses if addresses is not None else [endpoint.host])
    except EndpointRefused as refused:
        return f"refused: {refused}"
    return "allowed"


def test_urls_are_parsed_into_host_and_port() -> None:
    assert endpoint_of("https://API.Example.com/v1").host == "api.example.com"
    assert endpoint_of("https://api.example.com/v1").port == 443
    assert endpoint_of("http://[::1]:8080/v1").host == "::1"
    assert endpoint_of("http://[::ffff:127.0.0.1]/").host == "127.0.0.1"
    for bad in ("ftp://x", "http://", "http://x:99999/", "http://u:p@x/", "not a url"):
        with pytest.raises(EndpointRefused):
            endpoint_of(bad)


def test_only_listed_hosts_are_allowed() -> None:
    allowed = AllowedHosts.parse("api.example.com, llm.example.org:8443")
    public = ["93.184.216.34"]
    assert judge(allowed, "https://api.example.com/v1", public) == "allowed"
    assert judge(allowed, "http://api.example.com:9000/v1", public) == "allowed"
    assert judge(allowed, "https://llm.example.org:8443/v1", public) == "allowed"
    assert "not in RUNTIME_LLM_ALLOWED_HOSTS" in judge(allowed, "https://llm.example.org/v1", public)
    assert "not in RUNTIME_LLM_ALLOWED_HOSTS" in judge(allowed, "https://evil.example.net/v1", public)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/v1",
        "http://10.1.2.3/v1",
        "http://172.16.0.1/v1",
        "http://192.168.1.1/v1",
        "http://169.254.169.254/latest",
        "http://0.0.0.0/v1",
        "http://100.64.0.1/v1",
        "http://[::1]/v1",
        "http://[::]/v1",
        "http://[fe80::1]/v1",
        "http://[fd00::1]/v1",
        "http://[::ffff:10.0.0.1]/v1",
    ],
)
def test_internal_addresses_are_refused_unless_listed(url: str) -> None:
    assert "internal address" in judge(AllowedHosts(), url)
    host = endpoint_of(url).host
    listed = f"[{host}]" if ":" in host else host
    assert judge(AllowedHosts([listed]), url) == "allowed"


def test_a_listed_name_resolving_to_an_internal_address_is_refused_unless_the_address_is_listed() -> None:
    url = "http://llm.example.com/v1"
    assert "resolves to 127.0.0.1" in judge(AllowedHosts(["llm.example.com"]), url, ["127.0.0.1"])
    assert "resolves to ::1" in judge(AllowedHosts(["llm.example.com"]), url, ["93.184.216.34", "::1"])
    assert judge(AllowedHosts(["llm.example.com", "127.0.0.1"]), url, ["127.0.0.1"]) == "allowed"


def test_the_runtimes_own_endpoint_is_always_allowed() -> None:
    allowed = AllowedHosts(trusted_url="http://localhost:8080/v1")
    assert judge(allowed, "http://localhost:8080/v1", ["127.0.0.1"]) == "allowed"
    assert judge(allowed, "http://localhost:9999/other", ["127.0.0.1"]) == "allowed"


def test_malformed_entries_are_all_named() -> None:
    with pytest.raises(ValueError, match="RUNTIME_LLM_ALLOWED_HOSTS") as caught:
        AllowedHosts.parse("ok.example.com, http://x/, host:port, [::1, a:1:")
    for bad in ("http://x/", "host:port", "[::1"):
        assert bad in str(caught.value)


async def test_the_guard_resolves_names_when_it_checks() -> None:
    answers = {"llm.example.com": ["93.184.216.34"]}

    async def resolve(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("no such name")
        return answers[host]

    guard = EndpointGuard(AllowedHosts(["llm.example.com", "gone.example.com"]), resolve)
    await guard.check("https://llm.example.com/v1")
    answers["llm.example.com"] = ["127.0.0.1"]  # DNS now points inside
    with pytest.raises(EndpointNotAllowed, match=r"resolves to 127\.0\.0\.1"):
        await guard.check("https://llm.example.com/v1")
    with pytest.raises(EndpointNotAllowed, match="cannot be resolved"):
        await guard.check("https://gone.example.com/v1")


async def test_the_router_checks_an_agents_endpoint_before_each_request() -> None:
    answers = {"llm.example.com": ["93.184.216.34"]}

    async def resolve(host: str, port: int) -> list[str]:
        return answers[host]

    made: list[str] = []

    def endpoint(url: str) -> ScriptedLLM:
        made.append(url)
        return ScriptedLLM()

    router = ModelRouter(
        offline=ScriptedLLM(),
        endpoint=endpoint,
        default_base_url="",
        guard=EndpointGuard(AllowedHosts(["llm.example.com"]), resolve),
    )
    request = CompletionRequest(
        messages=[], settings=ModelSettings(model="m", base_url="https://llm.example.com/v1")
    )
    answers["llm.example.com"] = ["10.0.0.7"]
    with pytest.raises(LLMRejected, match=r"resolves to 10\.0\.0\.7"):
        async for _ in router.stream(request):
            pass
    assert made == []  # no connection was made
