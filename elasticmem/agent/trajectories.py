"""Expert trajectories of ALFWorld games, and the memory / imitation split of them.

    python -m elasticmem.agent.trajectories collect --data $ALFWORLD_DATA --split train \
        --out runs/alfworld/trajectories.jsonl [--processes 2] [--max-steps 50] [--limit N]
    python -m elasticmem.agent.trajectories split runs/alfworld/trajectories.jsonl \
        --out runs/alfworld/pools            # memory_ids.txt / imitation_ids.txt (80 / 20, seed 42)

``collect`` runs ALFWorld's handcoded expert in the real engine over every game of a split and
appends one JSON line per game as it finishes (game id, task type, objective, first observation,
then per step the admissible commands, the expert's action and the observation after it, and
success), so an interrupted run loses at most the games in flight and the same command resumes
with the games not yet written. ``split`` keeps the successful trajectories of at least
``min_steps`` steps, shuffles their ids with ``seed`` and cuts them into a memory pool (distilled
into skill cards) and an imitation pool (per-step GRPO examples), as the reference code does; the
id lists are written once and then frozen: a later ``split`` with other trajectories refuses to
overwrite them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
from pathlib import Path
from typing import Any, Iterable

from tqdm import tqdm

from elasticmem.agent.alfworld_env import AlfworldEnv, ExpertFailed, Game, find_games, split_dir


def expert_trajectory(game: Game, max_steps: int = 50, timeout_s: float = 240.0) -> dict[str, Any]:
    """Play ``game`` with the handcoded expert; the record ``collect`` writes.

    ``steps[i]`` holds the commands admissible before action i, the action and the observation
    after it. ``success`` is a win within ``max_steps`` steps and ``timeout_s`` seconds;
    ``failure`` says why not ('expert gave up', 'step limit', 'time limit')."""
    env = AlfworldEnv(game.path, expert=True, max_steps=max_steps, timeout_s=timeout_s)
    try:
        obs = env.reset()
        record: dict[str, Any] = {
            "game_id": game.game_id, "task_type": game.task_type, "objective": env.objective,
            "observation": obs.text, "steps": [], "success": False,
        }
        failure = None
        while not obs.done:
            action = obs.expert_action
            if action is None or action not in obs.admissible:
                failure = f"expert proposed an inadmissible command {action!r}"
                break
            admissible = obs.admissible
            try:
                obs = env.step(action)
            except ExpertFailed:
                failure = "expert gave up"
                break
            record["steps"].append({"admissible": admissible, "action": action, "observation": obs.text})
        if obs.won:
            record["success"] = True
        elif failure is None:
            failure = "step limit" if env.steps >= max_steps else "time limit"
        if failure is not None:
            record["failure"] = failure
        return record
    finally:
        env.close()


def _play(args: tuple[Game, int, float]) -> dict[str, Any]:
    return expert_trajectory(*args)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a trajectories JSONL; a truncated last line (a crash mid-write) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON line") from None
    return records


def collect(games: Iterable[Game], out: str | Path, processes: int = 1, max_steps: int = 50,
            timeout_s: float = 240.0, progress: bool = True) -> list[dict[str, Any]]:
    """Play every game not yet in ``out`` with the expert; append each record as it finishes.

    Records come in completion order; ``read_records(out)`` sorted by game id is the same for
    any number of processes. Returns every record in ``out`` afterwards, sorted by game id."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_records(out)
    have = {r["game_id"] for r in done}
    if done:  # rewrite without a truncated tail so appends start on a fresh line
        out.write_text("".join(json.dumps(r) + "\n" for r in done))
    todo = [g for g in games if g.game_id not in have]
    jobs = [(g, max_steps, timeout_s) for g in todo]
    bar = tqdm(total=len(jobs), desc="expert trajectories", unit="game", disable=not progress)
    with out.open("a") as f:
        if processes <= 1:
            results = map(_play, jobs)
            pool = None
        else:
            # spawn: each worker imports the engine afresh (TextWorld state is not fork-safe)
            pool = mp.get_context("spawn").Pool(processes)
            results = pool.imap_unordered(_play, jobs)
        try:
            for record in results:
                f.write(json.dumps(record) + "\n")
                f.flush()
                bar.update(1)
        finally:
            if pool is not None:
                pool.terminate()
            bar.close()
    return sorted(read_records(out), key=lambda r: r["game_id"])


def split_pools(records: list[dict[str, Any]], seed: int = 42, memory_fraction: float = 0.8,
                min_steps: int = 2) -> tuple[list[str], list[str]]:
    """(memory ids, imitation ids): successful trajectories with >= ``min_steps`` steps, ids
    sorted, shuffled with ``random.Random(seed)``, the first ``round(memory_fraction * n)`` to
    the memory pool."""
    if not 0.0 < memory_fraction < 1.0:
        raise ValueError(f"memory_fraction must be in (0, 1), got {memory_fraction}")
    ids = sorted(r["game_id"] for r in records if r.get("success") and len(r["steps"]) >= min_steps)
    random.Random(seed).shuffle(ids)
    cut = round(memory_fraction * len(ids))
    return ids[:cut], ids[cut:]


def write_pools(records: list[dict[str, Any]], out_dir: str | Path, **kw) -> tuple[list[str], list[str]]:
    """Write ``memory_ids.txt`` and ``imitation_ids.txt`` (one id a line) once; if they exist,
    return them as written, or raise if these records would split differently."""
    out_dir = Path(out_dir)
    memory, imitation = split_pools(records, **kw)
    files = out_dir / "memory_ids.txt", out_dir / "imitation_ids.txt"
    if all(p.exists() for p in files):
        frozen = [p.read_text().split() for p in files]
        if frozen != [memory, imitation]:
            raise ValueError(
                f"{out_dir} already holds a memory / imitation split ({len(frozen[0])} / {len(frozen[1])} ids) "
                f"that these trajectories do not reproduce ({len(memory)} / {len(imitation)}): the lists are "
                "frozen; write the new split to another folder"
            )
        return memory, imitation
    out_dir.mkdir(parents=True, exist_ok=True)
    for path, ids in zip(files, (memory, imitation)):
        path.write_text("".join(i + "\n" for i in ids))
    return memory, imitation


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m elasticmem.agent.trajectories", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="run the handcoded expert over a split's games")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="$ALFWORLD_DATA (games in json_2.1.1/<split>)")
    src.add_argument("--games", help="a folder of <task>/<trial>/ game folders")
    c.add_argument("--split", default="train", help="with --data: train, valid_seen or valid_unseen")
    c.add_argument("--out", required=True, help="JSONL to append to (resumes)")
    c.add_argument("--processes", type=int, default=1)
    c.add_argument("--max-steps", type=int, default=50, help="step limit of an expert episode")
    c.add_argument("--timeout-s", type=float, default=240.0, help="time limit of an expert episode")
    c.add_argument("--limit", type=int, default=0, help="only the first N games (sorted by id); 0 = all")
    s = sub.add_parser("split", help="the frozen 80/20 memory / imitation split")
    s.add_argument("trajectories")
    s.add_argument("--out", required=True, help="folder for memory_ids.txt and imitation_ids.txt")
    s.add_argument("--seed", type=int, default=42)
    s.add_argument("--memory-fraction", type=float, default=0.8)
    s.add_argument("--min-steps", type=int, default=2)
    a = p.parse_args(argv)
    if a.cmd == "collect":
        root = split_dir(a.data, a.split) if a.data else Path(a.games)
        games = find_games(root)
        if a.limit:
            games = games[: a.limit]
        records = collect(games, a.out, processes=a.processes, max_steps=a.max_steps, timeout_s=a.timeout_s)
        won = sum(r["success"] for r in records)
        print(f"{a.out}: {len(records)} trajectories, {won} successful", file=sys.stderr)
    else:
        memory, imitation = write_pools(read_records(a.trajectories), a.out, seed=a.seed,
                                        memory_fraction=a.memory_fraction, min_steps=a.min_steps)
        print(f"{a.out}: {len(memory)} memory, {len(imitation)} imitation trajectories", file=sys.stderr)


if __name__ == "__main__":
    main()
