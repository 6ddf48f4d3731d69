"""Generated household games for the real ALFWorld engine, for runs without the ALFWorld data.

    python -m elasticmem.agent.generate_games ../shared/data/alfworld_sample_game \
        --out runs/alfworld/generated/train --n 40 --seed 0 [--task-types 1 3 4 5 6]
    python -m elasticmem.agent.generate_games ../shared/data/alfworld_sample_game \
        --out runs/alfworld/generated/valid --n 30 --seed 1 --exclude runs/alfworld/generated/train

Every game is the scene of one ALFWorld trial (its rooms, objects, receptacles and their
places, from ``initial_state.pddl``) with another goal: a task type, a target object type and a
destination receptacle type drawn from what the scene affords (objects that are pickupable and,
for the task type, cleanable / heatable / coolable; two instances for pick-two; receptacles that
can contain the object; a toggleable lamp for look-at-in-light), with the goal formula and the
goal sentences of ALFWorld's own goal library. Each game is written as a trial folder
(``<task>-<Object>-None-<Receptacle>-gen<k>/trial_gen``, ``initial_state.pddl``,
``traj_data.json``, ``game.tw-pddl``) and kept only if ALFWorld's handcoded expert wins it within
``max_steps`` and needs at least ``min_steps`` actions (a goal the scene already satisfies, such as
a mug on a countertop when one is there, is no task), so every generated game is solvable. These games are generated, not ALFWorld's:
results on them are not comparable with the paper's.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from elasticmem.agent.alfworld_env import TASK_TYPES, build_game_file, import_alfworld, read_game
from elasticmem.agent.trajectories import expert_trajectory

# What each task type needs the target object to be, besides pickupable.
_NEEDS = {"pick_clean_then_place_in_recep": "cleanable", "pick_heat_then_place_in_recep": "heatable",
          "pick_cool_then_place_in_recep": "coolable"}
# Appliances a task uses on the object: not a destination for it.
_TOOLS = {"pick_clean_then_place_in_recep": {"SinkBasin", "Sink"}, "pick_heat_then_place_in_recep": {"Microwave"},
          "pick_cool_then_place_in_recep": {"Fridge"}}
_LAMPS = ("DeskLamp", "FloorLamp")


@dataclass(frozen=True)
class Task:
    task_type: str
    obj: str
    """Object type without 'Type', e.g. 'Potato'."""
    recep: str = ""
    """Destination receptacle type, e.g. 'SinkBasin' ('' for look-at-in-light)."""
    toggle: str = ""
    """The lamp type for look-at-in-light."""


@dataclass
class Scene:
    objects: dict[str, int]
    """Object type -> instances."""
    properties: dict[str, list[set[str]]]
    """Object type -> the properties of each instance (pickupable, heatable, ...)."""
    receptacles: set[str]
    contains: set[tuple[str, str]]
    """(receptacle type, object type) pairs of canContain."""


def read_scene(problem: str) -> Scene:
    """The object and receptacle types of a PDDL problem and what they afford."""
    inst_type = dict(re.findall(r"\(objectType (\S+) (\w+)Type\)", problem))
    objects: dict[str, int] = defaultdict(int)
    for t in inst_type.values():
        objects[t] += 1
    by_inst: dict[str, set[str]] = defaultdict(set)
    for prop, inst in re.findall(r"\((pickupable|heatable|coolable|cleanable|toggleable) (\S+)\)", problem):
        by_inst[inst].add(prop)
    properties: dict[str, list[set[str]]] = defaultdict(list)
    for inst, t in inst_type.items():
        properties[t].append(by_inst[inst])
    receptacles = set(re.findall(r"\(receptacleType \S+ (\w+)Type\)", problem))
    contains = set(re.findall(r"\(canContain (\w+)Type (\w+)Type\)", problem))
    return Scene(dict(objects), dict(properties), receptacles, contains)


def possible_tasks(scene: Scene, task_types: tuple[int, ...] = tuple(TASK_TYPES)) -> list[Task]:
    """Every task of the wanted types the scene affords, in a fixed order."""
    out = []
    for tt in (TASK_TYPES[t] for t in sorted(task_types)):
        for obj in sorted(scene.objects):
            need = {"pickupable"} | ({_NEEDS[tt]} if tt in _NEEDS else set())
            usable = sum(need <= props for props in scene.properties.get(obj, []))
            if usable < (2 if tt == "pick_two_obj_and_place" else 1):
                continue
            if tt == "look_at_obj_in_light":
                out += [Task(tt, obj, toggle=lamp) for lamp in _LAMPS if lamp in scene.objects]
                continue
            for recep in sorted(scene.receptacles - _TOOLS.get(tt, set())):
                if (recep, obj) in scene.contains:
                    out.append(Task(tt, obj, recep))
    return out


def goal_problem(problem: str, task: Task) -> str:
    """``problem`` with its goal replaced by ALFWorld's goal formula for ``task``."""
    import_alfworld()  # the clear error when the agent extra is missing
    from alfworld.gen import goal_library

    template = goal_library.gdict[task.task_type]["pddl"]
    goal = template.replace("#", "-").format(obj=task.obj, recep=task.recep, toggle=task.toggle, mrecep="")
    i = problem.find("(:goal")
    if i < 0:
        raise ValueError("the PDDL problem has no (:goal ...) section to replace")
    return problem[:i] + goal.strip() + "\n"


def write_task(trial_dir: Path, task: Task, out_dir: Path, seed: int) -> Path:
    """A trial folder for ``task`` in the scene of ``trial_dir``; returns its game file."""
    traj = json.loads((trial_dir / "traj_data.json").read_text())
    traj["task_type"] = task.task_type
    traj["pddl_params"] = {"object_target": task.obj, "parent_target": task.recep, "toggle_target": task.toggle,
                           "mrecep_target": "", "object_sliced": False}
    traj["task_id"] = out_dir.name
    traj.pop("turk_annotations", None)  # the human goal sentences describe the original task
    traj.pop("plan", None)  # and the original plan solves it, not this one
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "initial_state.pddl").write_text(goal_problem((trial_dir / "initial_state.pddl").read_text(), task))
    (out_dir / "traj_data.json").write_text(json.dumps(traj))
    return build_game_file(out_dir, out_dir, seed=seed)


def _folder_name(task: Task) -> str:
    return f"{task.task_type}-{task.obj}-None-{task.recep or task.toggle}"


def _task_name(folder: str) -> str:
    """The task of a generated game's folder name (without its -gen<k> suffix)."""
    return re.sub(r"-gen\d+$", "", folder)


def untaken(tasks: Sequence[Task], exclude: Sequence[str | Path]) -> list[Task]:
    """``tasks`` less those with a generated game in a folder of ``exclude``."""
    taken = {_task_name(d.name) for root in exclude for d in Path(root).iterdir() if d.is_dir()}
    return [t for t in tasks if _folder_name(t) not in taken]


def generate(trial_dir: str | Path, out_root: str | Path, n: int, seed: int = 0,
             task_types: tuple[int, ...] = tuple(TASK_TYPES), max_steps: int = 50, min_steps: int = 2,
             progress: bool = True, exclude: Sequence[str | Path] = ()) -> list[dict]:
    """Up to ``n`` solvable games from the scene of ``trial_dir`` in ``out_root``; returns the
    expert's trajectory of each kept game (its record as ``trajectories.collect`` writes it).
    Tasks are drawn without replacement with ``random.Random(seed)``; a game the expert does not
    win in ``min_steps..max_steps`` actions is removed and the next task is tried. Tasks already
    generated under a folder of ``exclude`` (e.g. the training games, when generating held-out
    ones) are not drawn."""
    trial_dir, out_root = Path(trial_dir), Path(out_root)
    tasks = untaken(possible_tasks(read_scene((trial_dir / "initial_state.pddl").read_text()), task_types), exclude)
    if not tasks:
        raise ValueError(f"the scene of {trial_dir} affords none of the task types {task_types}")
    random.Random(seed).shuffle(tasks)
    kept: list[dict] = []
    bar = tqdm(total=n, desc="generated games", unit="game", disable=not progress)
    for k, task in enumerate(tasks):
        if len(kept) == n:
            break
        folder = out_root / f"{_folder_name(task)}-gen{k}" / "trial_gen"
        game = read_game(write_task(trial_dir, task, folder, seed), out_root)
        record = expert_trajectory(game, max_steps=max_steps)
        if record["success"] and len(record["steps"]) >= min_steps:
            kept.append(record)
            bar.update(1)
        else:
            shutil.rmtree(folder.parent)
    bar.close()
    return kept


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m elasticmem.agent.generate_games",
                                description="Solvable ALFWorld games with new goals in the scene of one trial.")
    p.add_argument("trial", help="a trial folder with initial_state.pddl and traj_data.json")
    p.add_argument("--out", required=True, help="folder for the generated <task>/<trial>/ game folders")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task-types", type=int, nargs="+", default=list(TASK_TYPES),
                   help="ALFWorld task type ids: " + ", ".join(f"{k} {v}" for k, v in TASK_TYPES.items()))
    p.add_argument("--max-steps", type=int, default=50, help="the expert must win within this many steps")
    p.add_argument("--min-steps", type=int, default=2, help="and need at least this many")
    p.add_argument("--exclude", nargs="*", default=[],
                   help="folders of generated games whose tasks are not drawn again (e.g. the training games)")
    a = p.parse_args(argv)
    kept = generate(a.trial, a.out, a.n, a.seed, tuple(a.task_types), a.max_steps, a.min_steps, exclude=a.exclude)
    by_type: dict[str, int] = defaultdict(int)
    for r in kept:
        by_type[r["task_type"]] += 1
    print(f"{a.out}: {len(kept)} solvable games: {dict(sorted(by_type.items()))}", file=sys.stderr)


if __name__ == "__main__":
    main()
