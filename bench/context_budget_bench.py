"""The context budget: tokens sent per request over a long conversation.

A person tells an agent 500 short notes in a direct chat (one run each),
and the endpoint (the fake OpenAI server with `tests.windowed_llm`'s model,
which counts one token per 2.5 bytes of the request's JSON) records what
every request weighed. Twice: with a 4,096-token window (the budget keeps
each request within it) and with a window so large that everything is sent
(what the runtime did before the budget). Run with
`.venv/bin/python -m bench.context_budget_bench` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentim.im.v1 import im_pb2
from agentim.runtime.v1 import runtime_pb2 as rpb
from services.im.adapters import migrate as im_migrate
from services.im.adapters.sql import Database as IMDatabase
from tests.conftest import make_world, start_im, stop_im
from tests.fake_openai import FakeOpenAI
from tests.integration.test_runtime_grpc import start_runtime, stop_runtime
from tests.windowed_llm import WindowedModel


@dataclass(frozen=True)
class Outcome:
    label: str
    window: int
    prompts: list[int]
    summaries: int
    refusals: int
    failed_runs: int

    def row(self) -> str:
        ordered = sorted(self.prompts)
        p95 = ordered[int(len(ordered) * 0.95) - 1]
        return (
            f"| {self.label} | {self.window:,} | {len(self.prompts):,} | {statistics.median(ordered):,.0f} |"
            f" {p95:,} | {max(ordered):,} | {sum(ordered):,} | {self.summaries} | {self.refusals} |"
            f" {self.failed_runs} |"
        )


async def converse(label: str, window: int, messages: int, workdir: Path) -> Outcome:
    model = WindowedModel(window=window)
    fake = FakeOpenAI()
    fake.responder = model
    await fake.start()
    url = f"sqlite:///{workdir / f'{label}-im.db'}"
    database = IMDatabase(url)
    await im_migrate.upgrade(database)
    await database.aclose()
    im = await start_im(url)
    runtime = await start_runtime(
        im.address,
        workdir / f"{label}-runtime.db",
        OPENAI_BASE_URL=fake.url,
        OPENAI_MODEL="small-local-model",
        OPENAI_CONTEXT_TOKENS=str(window),
        RUNTIME_TOKEN_BUDGET="1000000000",
    )
    failed = 0
    try:
        world = await make_world(im.stub, people=1)
        md = world.md(0)
        agent = (await runtime.stub.CreateAgent(rpb.CreateAgentRequest(name="ada"), metadata=md)).agent
        chat = (
            await im.stub.GetOrCreateDirectGroup(
                im_pb2.GetOrCreateDirectGroupRequest(peer_member_id=agent.member_id), metadata=md
            )
        ).group
        watch = runtime.stub.WatchAgent(rpb.WatchAgentRequest(agent_id=agent.id), metadata=md)
        await watch.wait_for_connection()
        for number in range(1, messages + 1):
            text = f"Note {number}: the nightly build {number * 7} passed; nothing else to report."
            await im.stub.SendMessage(im_pb2.SendMessageRequest(group_id=chat.id, content=text), metadata=md)
            async for response in watch:
                if response.event.HasField("run_ended"):
                    failed += response.event.run_ended.status != rpb.RUN_STATUS_COMPLETED
                    break
        watch.cancel()
    finally:
        await stop_runtime(runtime)
        await stop_im(im)
        await fake.stop()
    return Outcome(label, window, model.prompt_sizes, model.summaries, model.refusals, failed)


async def main(messages: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        budget = await converse("with the budget", 4096, messages, Path(workdir))
        everything = await converse("everything sent", 1_000_000_000, messages, Path(workdir))
    print(f"{messages} messages, one run each; tokens as the endpoint counted them.\n")
    columns = ("Context", "Window", "Requests", "Median tokens", "p95", "Max", "Total", "Summaries")
    print(f"| {' | '.join(columns)} | Refusals | Failed runs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(budget.row())
    print(everything.row())
    print(
        f"\nTotal tokens sent with the budget: {sum(budget.prompts) / sum(everything.prompts):.2f}"
        " of sending everything."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=500)
    asyncio.run(main(parser.parse_args().messages))
