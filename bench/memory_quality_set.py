"""A bilingual quality set for long-term memory retrieval, written for the benchmark.

Synthetic runs of a software team's agent (people telling it things, the
agent's thinking, tool calls and their results, its answers), in English and
in Chinese, with the facts a later question should find among many look-alike
distractors. Each query names the segments that answer it and belongs to a
slice:

- `en` and `zh`: the fact and the question in the same language, worded differently;
- `zh_en`: the question in the other language than the fact (both directions);
- `identifiers`: the question quotes an exact identifier (an error code, a
  path, a function name) that the answer holds;
- `latest`: a value that changed over time (who is on call, a release date,
  a budget): only the newest statement answers;
- `time`: the same kind of event happened several times; a time range
  (a filter of the query) picks the one asked about.

Everything is generated from templates with a fixed seed: the same set every
time, with no file to keep.
"""

# Chinese text is written with its own (full-width) punctuation.
# ruff: noqa: RUF001

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

SEGMENT_TYPES = ("user_message", "reasoning", "tool_call", "tool_result", "response")
SLICES = ("en", "zh", "zh_en", "identifiers", "latest", "time")
START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


@dataclass(frozen=True)
class Segment:
    id: str
    run_id: str
    type: str
    text: str
    time: datetime
    group: str


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    slice: str
    relevant: frozenset[str]
    # Earlier statements of the value a `latest` query asks for (they no longer answer it).
    superseded: frozenset[str] = frozenset()
    # Optional time range (inclusive start, exclusive end) the query is asked within.
    since: datetime | None = None
    until: datetime | None = None


@dataclass
class Run:
    id: str
    time: datetime
    group: str
    segments: list[Segment] = field(default_factory=list)


@dataclass
class QualitySet:
    runs: list[Run]
    queries: list[Query]

    @property
    def segments(self) -> list[Segment]:
        return [s for run in self.runs for s in run.segments]


SERVICES = [
    "billing", "search", "checkout", "auth", "payments", "notifications",
    "analytics", "inventory", "shipping", "reporting", "gateway", "ledger",
]  # fmt: skip
PEOPLE = ["Ada", "Bea", "Cora", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea"]
TEAMS = [
    ("platform", "平台"),
    ("mobile", "移动端"),
    ("data", "数据"),
    ("growth", "增长"),
    ("infra", "基础设施"),
]
COMPONENTS = [
    ("worker pool", "工作进程池"), ("cache", "缓存"), ("message queue", "消息队列"),
    ("scheduler", "调度器"), ("database proxy", "数据库代理"), ("search index", "搜索索引"),
]  # fmt: skip
CUSTOMERS = ["Acme Corp", "Globex", "Initech", "Umbrella", "Hooli", "Soylent", "Wonka", "Stark Labs"]
LIBRARIES = ["protobuf", "sqlalchemy", "grpcio", "numpy", "redis-py", "aiohttp", "pydantic", "httpx"]
DAYS = [
    ("Monday", "周一"), ("Tuesday", "周二"), ("Wednesday", "周三"), ("Thursday", "周四"), ("Friday", "周五"),
]  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A kind of fact: how it is said and asked, in both languages.

    `key` is the slot the question names: two facts of a family never share
    its value, so that each question has one answer.
    """

    name: str
    say_en: str
    say_zh: str
    ask_en: str
    ask_zh: str
    key: str = "svc"


# Facts that a person tells the agent (or a tool reports), asked for later.
FAMILIES = [
    Family(
        "deploy_failure",
        "The {svc} deploy on {day} failed because the {comp} ran out of memory.",
        "{day_zh}{svc}的部署失败了，原因是{comp_zh}内存不足。",
        "why did the {svc} deployment break?",
        "{svc}上线为什么失败了？",
    ),
    Family(
        "latency",
        "After the cache change the p99 latency of {svc} went from {a} ms to {b} ms.",
        "缓存改动之后，{svc}的p99延迟从{a}毫秒涨到了{b}毫秒。",
        "how much slower did {svc} get after we changed the cache?",
        "改了缓存以后{svc}慢了多少？",
    ),
    Family(
        "customer_request",
        "{customer} asked us for a CSV export of all their {svc} invoices.",
        "{customer}希望我们把他们在{svc}里的全部发票导出成CSV。",
        "what did {customer} request from us?",
        "{customer}提了什么需求？",
        key="customer",
    ),
    Family(
        "postponed",
        "We agreed to postpone the {svc} migration to next sprint because {person} is on leave.",
        "因为{person}休假，我们决定把{svc}的迁移推迟到下个迭代。",
        "when are we doing the {svc} migration?",
        "{svc}迁移什么时候做？",
    ),
    Family(
        "budget_team",
        "The {team} team asked for {n} more GPUs for the {svc} experiments.",
        "{team_zh}团队为{svc}的实验申请了{n}块GPU。",
        "how many GPUs does the {team} team want?",
        "{team_zh}团队要多少块GPU？",
        key="team",
    ),
    Family(
        "review_habit",
        "{person} prefers reviewing pull requests in the morning and wants short descriptions.",
        "{person}喜欢上午看合并请求，而且希望描述写得简短。",
        "when does {person} like to do code reviews?",
        "{person}一般什么时候做代码评审？",
        key="person",
    ),
    Family(
        "outage_cause",
        "The {svc} outage last {day} was caused by an expired TLS certificate on the load balancer.",
        "上{day_zh}{svc}的故障是负载均衡器上的证书过期导致的。",
        "what took {svc} down?",
        "{svc}那次宕机是什么原因？",
    ),
    Family(
        "pinned_library",
        "We pinned {lib} to version {ver} because newer releases break the {svc} build.",
        "我们把{lib}固定在{ver}版本，因为新版本会让{svc}编译失败。",
        "why is {lib} held at an old version?",
        "为什么{lib}的版本被锁住了？",
        key="lib",
    ),
    Family(
        "flaky_test",
        "The flaky {svc} test comes from a race between the scheduler and the retry timer.",
        "{svc}那个时好时坏的测试，是调度器和重试定时器之间的竞争造成的。",
        "why does the {svc} test fail only sometimes?",
        "{svc}的测试为什么偶尔失败？",
    ),
    Family(
        "interviews",
        "{person} is interviewing two backend candidates for the {team} team on {day}.",
        "{person}{day_zh}要给{team_zh}团队面试两位后端候选人。",
        "who is interviewing backend engineers for {team}?",
        "谁在给{team_zh}团队面试后端工程师？",
        key="team",
    ),
    Family(
        "disk_usage",
        "The {svc} database is at {pct} percent disk usage and needs a larger volume this month.",
        "{svc}数据库的磁盘已经用了{pct}%，这个月需要扩容。",
        "is the {svc} database running out of storage?",
        "{svc}的数据库磁盘快不够了吗？",
    ),
    Family(
        "feature_flag",
        "The new {svc} onboarding flow is behind a feature flag, enabled for ten percent of users.",
        "{svc}新的引导流程挂在功能开关后面，目前只对百分之十的用户开放。",
        "how many users see the new {svc} onboarding?",
        "{svc}的新引导流程开放给了多少用户？",
    ),
]

# Facts holding an exact identifier; the question quotes it.
IDENTIFIER_FAMILIES = [
    Family(
        "error_code",
        "Error {code} from {svc} means the service token has expired; refresh it with the admin CLI.",
        "{svc}返回的错误码{code}表示服务令牌过期了，要用管理命令行刷新。",
        "what does {code} mean?",
        "{code}是什么错误？",
        key="code",
    ),
    Family(
        "config_path",
        "The {svc} rate limits are configured in {path}, reloaded on every deploy.",
        "{svc}的限流参数写在{path}里，每次部署都会重新加载。",
        "what is configured in {path}?",
        "{path}里面配置的是什么？",
        key="path",
    ),
    Family(
        "function_bug",
        "The bug is in {func}(): it rounds {svc} amounts before converting the currency.",
        "问题出在{func}()：它在换算币种之前就把{svc}的金额四舍五入了。",
        "what is wrong with {func}?",
        "{func}有什么问题？",
        key="func",
    ),
]

# Values that change over time: only the newest statement answers.
SERIES = [
    Family(
        "on_call",
        "{person} is on call for {svc} from now on.",
        "从现在起{svc}由{person}值班。",
        "who is on call for {svc} now?",
        "{svc}现在是谁值班？",
    ),
    Family(
        "release_date",
        "The {svc} 2.0 release is now planned for {day}.",
        "{svc} 2.0 的发布时间现在定在{day_zh}。",
        "when is {svc} 2.0 going to ship?",
        "{svc} 2.0 什么时候发布？",
    ),
    Family(
        "quota",
        "The {svc} API quota for partners is now {n} thousand calls per day.",
        "{svc}给合作方的接口配额现在是每天{n}千次。",
        "what is the current partner quota of the {svc} API?",
        "{svc}接口现在给合作方的配额是多少？",
    ),
]

DISTRACTORS_EN = [
    "Checked the {svc} dashboards; nothing unusual in the last hour.",
    "I will look at the {svc} logs after lunch.",
    "Thanks, that helps.",
    "Can you summarise the open {svc} tickets?",
    "The {svc} standup moved to 10:30 today.",
    "{person} is reviewing the {svc} pull request.",
    "Let me read the recent messages of this chat first.",
    "I should check which groups mention {svc} before answering.",
    "There are three open issues about {svc} performance.",
    "Merged the docs fix for {svc}.",
    "{person} asked whether the {svc} staging environment is up.",
    "The {svc} nightly job finished in 14 minutes.",
]
DISTRACTORS_ZH = [
    "看了一下{svc}的监控面板，最近一小时没有异常。",
    "我午饭后再看{svc}的日志。",
    "谢谢，这很有帮助。",
    "能帮我总结一下{svc}还没关闭的工单吗？",
    "今天{svc}的站会改到十点半了。",
    "{person}正在评审{svc}的合并请求。",
    "我先看看这个群里最近的消息。",
    "回答之前我应该查一下哪些群提到了{svc}。",
    "关于{svc}性能的问题有三个还没解决。",
    "{svc}的文档修复已经合并了。",
    "{person}问{svc}的预发环境是不是正常。",
    "{svc}的夜间任务十四分钟就跑完了。",
]
TOOL_CALLS = [
    'read_history {{"group_id": "{group}", "limit": 20}}',
    'list_groups {{}}',
    'send_direct_message {{"to": "{person}", "content": "ping about {svc}"}}',
    'list_members {{}}',
]  # fmt: skip


class _Builder:
    def __init__(self, seed: int, runs: int) -> None:
        self.rng = random.Random(seed)
        self.runs: list[Run] = []
        self.queries: list[Query] = []
        self._run_count = runs
        self._segment = 0

    def distinct(self, family: Family, count: int, *, taken: set[str] | None = None) -> list[dict[str, str]]:
        """Slots for `count` facts of a family, no two with the same key value (nor one in `taken`)."""
        seen = set(taken or ())
        found: list[dict[str, str]] = []
        for _ in range(count * 50):
            slots = self._slots()
            if slots[family.key] not in seen:
                seen.add(slots[family.key])
                found.append(slots)
                if len(found) == count:
                    return found
        raise AssertionError(f"not {count} distinct {family.key} values for {family.name}")

    def _slots(self) -> dict[str, str]:
        rng = self.rng
        day_en, day_zh = rng.choice(DAYS)
        team_en, team_zh = rng.choice(TEAMS)
        comp_en, comp_zh = rng.choice(COMPONENTS)
        major, minor = rng.randint(1, 9), rng.randint(0, 30)
        return {
            "svc": rng.choice(SERVICES),
            "person": rng.choice(PEOPLE),
            "day": day_en,
            "day_zh": day_zh,
            "team": team_en,
            "team_zh": team_zh,
            "comp": comp_en,
            "comp_zh": comp_zh,
            "customer": rng.choice(CUSTOMERS),
            "lib": rng.choice(LIBRARIES),
            "ver": f"{major}.{minor}.{rng.randint(0, 9)}",
            "a": str(rng.randint(80, 200)),
            "b": str(rng.randint(400, 900)),
            "n": str(rng.randint(2, 48)),
            "pct": str(rng.randint(81, 97)),
            "code": f"E{rng.randint(1000, 9999)}",
            "path": self._path(),
            "func": self._function(),
            "group": f"group-{rng.randint(1, 12)}",
        }

    def _path(self) -> str:
        kind = self.rng.choice(["limits", "quota", "throttle"])
        return f"/etc/{self.rng.choice(SERVICES)}/{kind}-{self.rng.randint(1, 99)}.yaml"

    def _function(self) -> str:
        verb = self.rng.choice(["normalize", "convert", "settle", "apply"])
        thing = self.rng.choice(["invoice", "refund", "payout", "fee"])
        return f"{verb}_{thing}_{self.rng.choice(['amounts', 'totals', 'lines'])}"

    def new_run(self, time: datetime) -> Run:
        run = Run(id=f"run-{len(self.runs):04d}", time=time, group=f"group-{self.rng.randint(1, 12)}")
        self.runs.append(run)
        return run

    def add(self, run: Run, kind: str, text: str, offset_s: int) -> Segment:
        segment = Segment(
            id=f"seg-{self._segment:05d}",
            run_id=run.id,
            type=kind,
            text=text,
            time=run.time + timedelta(seconds=offset_s),
            group=run.group,
        )
        self._segment += 1
        run.segments.append(segment)
        return segment

    def chatter(self, run: Run, count: int, zh: bool) -> None:
        """Look-alike segments that answer nothing: thinking, tool calls and results, small talk."""
        for index in range(count):
            slots = self._slots()
            pool = DISTRACTORS_ZH if zh else DISTRACTORS_EN
            kind = self.rng.choice(SEGMENT_TYPES)
            if kind == "tool_call":
                text = self.rng.choice(TOOL_CALLS).format(**slots)
            else:
                text = self.rng.choice(pool).format(**slots)
            self.add(run, kind, text, 10 + index * 7)

    def query(
        self,
        text: str,
        slice_: str,
        relevant: list[Segment],
        *,
        superseded: Sequence[Segment] = (),
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> None:
        self.queries.append(
            Query(
                id=f"q-{len(self.queries):04d}",
                text=text,
                slice=slice_,
                relevant=frozenset(s.id for s in relevant),
                superseded=frozenset(s.id for s in superseded),
                since=since,
                until=until,
            )
        )

    def run_time(self, index: int) -> datetime:
        # Runs spread over about four months, a few per working day.
        return START + timedelta(hours=7 * index + self.rng.randint(0, 5))


def build_quality_set(*, seed: int = 7, runs: int = 140) -> QualitySet:
    """The quality set: about 250 runs, 3,000+ segments and 200+ queries."""
    b = _Builder(seed, runs)
    facts: list[tuple[Family, dict[str, str], bool]] = []
    for family in FAMILIES:
        count = 5
        facts += [(family, slots, b.rng.random() < 0.5) for slots in b.distinct(family, count)]
    for family in IDENTIFIER_FAMILIES:
        facts += [(family, slots, b.rng.random() < 0.5) for slots in b.distinct(family, 8)]
    b.rng.shuffle(facts)
    series = [(family, slots) for family in SERIES for slots in b.distinct(family, 10)]
    # The deploy failures of the time slice are of services no other deploy failure is about.
    deploys = {slots["svc"] for family, slots, _ in facts if family is FAMILIES[0]}
    timed = b.distinct(FAMILIES[0], 5, taken=deploys)
    _facts_in_runs(b, facts, runs)
    for family, base in series:
        _series(b, family, base)
    for base in timed:
        _timed(b, base)
    return QualitySet(runs=b.runs, queries=b.queries)


def _facts_in_runs(b: _Builder, facts: list[tuple[Family, dict[str, str], bool]], runs: int) -> None:
    """Runs of chatter, each telling one or two facts; each fact asked in its language and the other."""
    per_run = max(1, len(facts) // runs + 1)
    pending = list(facts)
    for index in range(runs):
        zh = b.rng.random() < 0.5
        run = b.new_run(b.run_time(index))
        b.chatter(run, b.rng.randint(5, 9), zh)
        for offset in range(per_run):
            if not pending:
                break
            family, slots, fact_zh = pending.pop()
            kind = b.rng.choice(["user_message", "tool_result", "response"])
            said = b.add(run, kind, (family.say_zh if fact_zh else family.say_en).format(**slots), 5 + offset)
            same = (family.ask_zh if fact_zh else family.ask_en).format(**slots)
            other = (family.ask_en if fact_zh else family.ask_zh).format(**slots)
            if family in IDENTIFIER_FAMILIES:
                b.query(same, "identifiers", [said])
                b.query(other, "identifiers", [said])
            else:
                b.query(same, "zh" if fact_zh else "en", [said])
                b.query(other, "zh_en", [said])
        b.chatter(run, b.rng.randint(5, 9), zh)


def _series(b: _Builder, family: Family, base: dict[str, str]) -> None:
    """Three statements of a changing value, a month apart in runs of their own; the last answers."""
    versions: list[Segment] = []
    fact_zh = b.rng.random() < 0.5
    for version in range(3):
        changed = b._slots()
        slots = dict(base, **{key: changed[key] for key in ("person", "day", "day_zh", "n")})
        run = b.new_run(START + timedelta(days=30 * version + b.rng.randint(0, 20)))
        b.chatter(run, b.rng.randint(4, 7), fact_zh)
        versions.append(
            b.add(run, "user_message", (family.say_zh if fact_zh else family.say_en).format(**slots), 3)
        )
        b.chatter(run, b.rng.randint(4, 7), fact_zh)
    ask = family.ask_zh if b.rng.random() < 0.5 else family.ask_en
    b.query(ask.format(**base), "latest", [versions[-1]], superseded=versions[:-1])


def _timed(b: _Builder, base: dict[str, str]) -> None:
    """The same service's deploy failed in three months for three reasons; each month is asked about."""
    fact_zh = b.rng.random() < 0.5
    family = FAMILIES[0]
    for month, (comp_en, comp_zh) in enumerate(COMPONENTS[:3]):
        slots = dict(base, comp=comp_en, comp_zh=comp_zh)
        run = b.new_run(START + timedelta(days=31 * month + b.rng.randint(0, 25)))
        b.chatter(run, b.rng.randint(4, 7), fact_zh)
        said = b.add(run, "user_message", (family.say_zh if fact_zh else family.say_en).format(**slots), 3)
        b.chatter(run, b.rng.randint(4, 7), fact_zh)
        since = START + timedelta(days=31 * month)
        ask = (family.ask_zh if b.rng.random() < 0.5 else family.ask_en).format(**slots)
        b.query(ask, "time", [said], since=since, until=since + timedelta(days=31))


if __name__ == "__main__":
    built = build_quality_set()
    print(f"{len(built.runs)} runs, {len(built.segments)} segments, {len(built.queries)} queries")
    for name in SLICES:
        print(name, sum(1 for q in built.queries if q.slice == name))
