"""The real ALFWorld text engine (TextWorld + ALFWorld's wrappers) behind a small adapter.

    pip install -e ".[agent]"      # alfworld 0.4.2 (compiles fast-downward: ~5 min cold)

``AlfworldEnv(game_file).reset()`` / ``.step(command)`` return an ``Observation``: the text, the
admissible commands, won / done, and the handcoded expert's next command. Games are the
``game.tw-pddl`` files of ``$ALFWORLD_DATA/json_2.1.1/<split>/<task>/<trial>/`` (``find_games``), or
one built from a trial's ``initial_state.pddl`` and ``traj_data.json`` with the wheel's logic files
(``build_game_file``), e.g. the sample game of ``../shared/data/alfworld_sample_game``.

The engine's gotchas are handled here: loading a PDDL game overwrites ``sys.argv`` (fast-downward's
translator), so it is restored; ``ALFWORLD_DATA`` must be set before alfworld is imported
(``import_alfworld(data_dir)``); a folder with no games is an error, where ALFWorld's own
``AlfredTWEnv`` waits forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

# ALFWorld's six task types (alfworld.agents.environment.alfred_tw_env.TASK_TYPES), by its ids.
TASK_TYPES = {
    1: "pick_and_place_simple",
    2: "look_at_obj_in_light",
    3: "pick_clean_then_place_in_recep",
    4: "pick_heat_then_place_in_recep",
    5: "pick_cool_then_place_in_recep",
    6: "pick_two_obj_and_place",
}
SPLITS = ("train", "valid_seen", "valid_unseen")
_WELCOME = "-= Welcome to TextWorld, ALFRED! =-"
_TASK_PREFIX = "Your task is to: "
# fast-downward's planner library holds one game state per process: loading or resetting a game
# replaces it under every other env. The env that did so last is the only one that may step.
_live: weakref.ref | None = None


class ExpertFailed(RuntimeError):
    """The handcoded expert gave up (its own step limit) or proposed no admissible command."""


def import_alfworld(data_dir: str | Path | None = None) -> SimpleNamespace:
    """Import textworld and ALFWorld's text wrappers, with ``ALFWORLD_DATA`` set first.

    alfworld reads ``ALFWORLD_DATA`` once, at import; a ``data_dir`` given after that import
    cannot take effect, so it is an error rather than silently ignored.
    """
    if data_dir is not None:
        data_dir = str(Path(data_dir).expanduser())
        if "alfworld" in sys.modules and os.environ.get("ALFWORLD_DATA") != data_dir:
            raise RuntimeError(
                f"alfworld was already imported with ALFWORLD_DATA={os.environ.get('ALFWORLD_DATA')!r}; "
                f"it reads the variable once, so {data_dir!r} cannot take effect now: set ALFWORLD_DATA "
                "before starting Python"
            )
        os.environ["ALFWORLD_DATA"] = data_dir
    try:
        with _argv_kept():
            import alfworld
            import textworld
            from alfworld.agents.environment import alfred_tw_env
            from alfworld.agents.expert import HandCodedAgentTimeout
            from alfworld.agents.utils.misc import add_task_to_grammar
    except ImportError as e:
        raise ImportError(
            f"the ALFWorld engine is not installed ({e}); install the agent extra: pip install 'elasticmem[agent]'"
        ) from e
    return SimpleNamespace(
        alfworld=alfworld, textworld=textworld, wrappers=alfred_tw_env,
        add_task_to_grammar=add_task_to_grammar, expert_timeout=HandCodedAgentTimeout,
        logic_dir=Path(alfworld.__file__).parent / "data",
    )


@contextlib.contextmanager
def _argv_kept() -> Iterator[None]:
    """Restore ``sys.argv`` afterwards: fast-downward's translator replaces it on every game load."""
    saved = list(sys.argv)
    try:
        yield
    finally:
        sys.argv[:] = saved


@dataclass(frozen=True)
class Game:
    """One ALFWorld game: its ``game.tw-pddl`` and what ``traj_data.json`` beside it says."""

    path: Path
    game_id: str
    """The trial folder relative to the split folder, e.g. '<task>/trial_T2019...'."""
    task_type: str
    traj_data: Path | None = None


def read_game(game_file: str | Path, root: str | Path | None = None) -> Game:
    """A ``Game`` for ``game_file``; its id is the folder relative to ``root`` (default: its own name)."""
    path = Path(game_file)
    if not path.is_file():
        raise FileNotFoundError(f"no ALFWorld game file at {path}")
    folder = path.parent
    game_id = folder.relative_to(root).as_posix() if root is not None else folder.name
    traj = folder / "traj_data.json"
    task_type = json.loads(traj.read_text())["task_type"] if traj.is_file() else ""
    return Game(path=path, game_id=game_id, task_type=task_type, traj_data=traj if traj.is_file() else None)


def find_games(root: str | Path, task_types: tuple[int, ...] = tuple(TASK_TYPES)) -> list[Game]:
    """The solvable games under ``root`` (a split folder such as ``$ALFWORLD_DATA/json_2.1.1/train``),
    sorted by id, filtered as ALFWorld's ``AlfredTWEnv`` does: ``traj_data.json`` and a
    ``game.tw-pddl`` marked solvable, the wanted task types, no 'movable' or 'Sliced' trials.
    A folder that yields no game is an error (``AlfredTWEnv`` hangs on it)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"no ALFWorld game folder at {root}")
    wanted = {TASK_TYPES[t] for t in task_types}
    games, seen = [], 0
    for traj in sorted(root.rglob("traj_data.json")):
        seen += 1
        folder = traj.parent
        game_file = folder / "game.tw-pddl"
        if "movable" in str(folder) or "Sliced" in str(folder) or not game_file.is_file():
            continue
        if json.loads(traj.read_text())["task_type"] not in wanted:
            continue
        if not json.loads(game_file.read_text()).get("solvable", False):
            continue
        games.append(read_game(game_file, root))
    if not games:
        raise ValueError(
            f"no playable ALFWorld game under {root} ({seen} traj_data.json found): expected "
            "<task>/<trial>/{traj_data.json, game.tw-pddl} with the game marked solvable "
            "(run `alfworld-download`, or build_game_file for a trial without a game file)"
        )
    return games


def split_dir(data_dir: str | Path, split: str) -> Path:
    """``$ALFWORLD_DATA/json_2.1.1/<split>``."""
    if split not in SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {SPLITS}")
    return Path(data_dir).expanduser() / "json_2.1.1" / split


def single_agent_problem(problem: str) -> str:
    """A PDDL problem with one agent named ``agent1``.

    ALFWorld's logic expects one agent called agent1; multi-agent variants (such as the sample game
    from ALFWorld's multi-agent branch) declare several. The first declared agent is kept and
    renamed; every line naming another agent is dropped."""
    agents = re.findall(r"^\s*(\S+)\s+-\s+agent\s*$", problem, flags=re.MULTILINE)
    if not agents:
        raise ValueError("the PDDL problem declares no agent ('<name> - agent')")
    if agents == ["agent1"]:
        return problem
    keep, drop = agents[0], agents[1:]
    lines = [line for line in problem.splitlines()
             if not any(re.search(rf"(?<![\w-]){re.escape(a)}(?![\w-])", line) for a in drop)]
    return re.sub(rf"(?<![\w-]){re.escape(keep)}(?![\w-])", "agent1", "\n".join(lines) + "\n")


def build_game_file(trial_dir: str | Path, out_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Write ``game.tw-pddl`` for a trial folder holding ``initial_state.pddl`` and ``traj_data.json``.

    As ``alfworld-play-tw`` does: the installed wheel's domain and grammar, the goal sentence
    filled in from ``traj_data.json`` (its template drawn with ``seed``, so the sentence is
    fixed), the problem reduced to one agent, marked solvable. ``traj_data.json`` is copied
    beside it. Returns the game file's path (in ``out_dir``, default the trial folder)."""
    eng = import_alfworld()
    trial = Path(trial_dir)
    out = Path(out_dir) if out_dir is not None else trial
    traj_text = (trial / "traj_data.json").read_text()
    state = random.getstate()
    try:  # ALFWorld draws the goal template from the module-level random generator
        random.seed(seed)
        grammar = eng.add_task_to_grammar((eng.logic_dir / "alfred.twl2").read_text(), json.loads(traj_text))
    finally:
        random.setstate(state)
    game = {
        "pddl_domain": (eng.logic_dir / "alfred.pddl").read_text(),
        "grammar": grammar,
        "pddl_problem": single_agent_problem((trial / "initial_state.pddl").read_text()),
        "solvable": True,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "traj_data.json").write_text(traj_text)
    path = out / "game.tw-pddl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(game))
    tmp.replace(path)
    return path


@dataclass
class Observation:
    """What the agent sees after reset or a step."""

    text: str
    """The engine's feedback (after reset: the room description, without the welcome banner and the task line)."""
    admissible: list[str]
    """The commands the engine accepts now."""
    won: bool = False
    done: bool = False
    """Won, or the episode's step limit or time limit reached."""
    expert_action: str | None = None
    """The handcoded expert's next command (None when the env runs without the expert)."""
    truncated: bool = False
    """Done because of the step or time limit, not a win."""


@dataclass
class AlfworldEnv:
    """One ALFWorld game in the TextWorld engine, with ALFWorld's demangler and optional expert.

    ``max_steps`` and ``timeout_s`` bound an episode (the paper: 30 steps, 240 s): the step that
    reaches either returns ``done=True, truncated=True``. ALFWorld's handcoded expert breaks ties
    with the global ``random`` module; the env runs it on a generator of its own, seeded with
    ``seed`` at every reset, so an episode is reproducible and leaves the caller's ``random`` alone."""

    game_file: str | Path
    expert: bool = True
    max_steps: int = 30
    timeout_s: float = 240.0
    seed: int = 0
    objective: str = field(init=False, default="")
    task_type: str = field(init=False, default="")
    steps: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.timeout_s <= 0:
            raise ValueError(f"max_steps must be >= 1 and timeout_s > 0, got {self.max_steps}, {self.timeout_s}")
        self.game = read_game(self.game_file)
        self.task_type = self.game.task_type
        eng = import_alfworld()
        w = eng.wrappers
        self._timeout_error = eng.expert_timeout
        extras = ["gamefile"] + (["expert_plan"] if self.expert else [])
        infos = eng.textworld.EnvInfos(won=True, admissible_commands=True, extras=extras)
        wrappers = [w.AlfredDemangler(), w.AlfredInfos]
        if self.expert:
            wrappers.append(w.AlfredExpert(expert_type=w.AlfredExpertType.HANDCODED))
        with _argv_kept():
            self._env = eng.textworld.start(str(self.game.path), request_infos=infos, wrappers=wrappers)
        self._start = 0.0
        self._claim()

    def _claim(self) -> None:
        global _live
        _live = weakref.ref(self)

    def reset(self) -> Observation:
        """Start the episode again: the room, the objective (``self.objective``), the commands."""
        self._random_state = random.Random(self.seed).getstate()
        with _argv_kept(), self._own_random():
            state = self._env.reset()
        self._claim()
        self.steps, self._start = 0, time.monotonic()
        text = state.feedback.replace(_WELCOME, "").strip()
        lines = text.splitlines()
        task = [line for line in lines if line.startswith(_TASK_PREFIX)]
        self.objective = task[-1][len(_TASK_PREFIX):].strip() if task else ""
        text = "\n".join(line for line in lines if not line.startswith(_TASK_PREFIX)).strip()
        return self._observation(state, text)

    def step(self, command: str) -> Observation:
        """Run one command (any string: an inadmissible one gets the engine's 'Nothing happens.')."""
        if self._start == 0.0:
            raise RuntimeError("call reset() before step()")
        if _live is None or _live() is not self:
            raise RuntimeError(
                "another AlfworldEnv was created or reset after this one: the engine's planner state is "
                "process-global, so a process plays one game at a time (reset this env to play it again; "
                "run games in parallel in separate processes)"
            )
        try:
            with _argv_kept(), self._own_random():
                state, _, _ = self._env.step(command)
        except Exception as e:  # AlfredExpert turns the expert's own timeout into a bare Exception
            if str(e) == "Timeout":
                raise ExpertFailed(f"{self.game.game_id}: the handcoded expert gave up") from e
            raise
        self.steps += 1
        obs = self._observation(state, state.feedback.strip())
        if not obs.won and (self.steps >= self.max_steps or time.monotonic() - self._start >= self.timeout_s):
            obs.done = obs.truncated = True
        return obs

    @contextlib.contextmanager
    def _own_random(self) -> Iterator[None]:
        saved = random.getstate()
        random.setstate(self._random_state)
        try:
            yield
        finally:
            self._random_state = random.getstate()
            random.setstate(saved)

    def _observation(self, state, text: str) -> Observation:
        expert = None
        if self.expert:
            plan = state["extra.expert_plan"]
            expert = plan[0] if plan else None
        won = bool(state["won"])
        return Observation(text=text, admissible=list(state["admissible_commands"]), won=won, done=won,
                           expert_action=expert)

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> "AlfworldEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
