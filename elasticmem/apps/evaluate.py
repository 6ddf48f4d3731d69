"""Evaluate a checkpoint, a baseline, or a list of variants on one split, greedily.

    python evaluate.py --config configs/quickstart.yaml checkpoint=runs/train/quickstart/final split=test
    python evaluate.py --config configs/quickstart.yaml system=text_rag memory.retrieval=semantic --limit 20
    python evaluate.py --config configs/quickstart.yaml 'eval.variants={elasticmem: [], no_memory: [eval.system=no_memory], text_rag: [eval.system=text_rag]}'
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 evaluate.py --config ...   # 2 processes
    python evaluate.py --config configs/alfworld_cpu.yaml     # ALFWorld episodes (eval.task=alfworld)
    python evaluate.py --config configs/locomo_qa.yaml eval.stream=session   # memory grows session by session
    python evaluate.py --config configs/tiny.yaml system=memgen checkpoint=runs/train/memgen/final   # MemGen
    python evaluate.py --config configs/quickstart.yaml system=mem0 --limit 20   # Mem0 (or langmem), offline
    python evaluate.py --help                                  # every config key, documented
    elasticmem-eval --config configs/quickstart.yaml checkpoint=...   # the console script: the same command

``checkpoint=``, ``split=``, ``system=`` and ``limit=`` are short for ``eval.checkpoint=`` etc.;
``--limit N`` is ``eval.limit=N`` too.

A checkpoint on another data set (frozen transfer, docs/locomo.md): the model keeps the memory
settings it was trained with (``elasticmem_config.json``: content, retrieval, the policy and its
``max_budget``), so the target preset's ``memory.*`` keys do not apply; give the target's data and
bank (built with the same backbone, ``bank.n_cache`` >= the checkpoint's ``max_budget``), its
learned map if the checkpoint's retrieval uses one, and any reading setting the target needs on
the command line, e.g. the persona_shift checkpoint on LoCoMo:

    python evaluate.py --config configs/locomo_mc10.yaml checkpoint=RUN/final \\
        memory.retrieval_map=OUT/map.safetensors memory.top_z=4 memory.max_new_tokens=80 eval.budgets=top1
The output folder (eval.output_dir, one subfolder per variant) gets results.json,
predictions.jsonl, report.md, case_study.md and, for ElasticMem, the budget plots;
with variants also comparison.md and accuracy_vs_tokens.png, and seeds.md (mean and
interval over training seeds, paired by seed) when variant names say ``system@seed``
(``{elasticmem@0: [eval.checkpoint=A/final], elasticmem@1: [...], memgen@0: [...]}``). Running the same
command again resumes: examples already answered are not answered again. A folder
holding predictions of another system, checkpoint, setting or data file is refused;
eval.overwrite=true deletes them and starts over.

(``evaluate.py`` at the repository root and the ``elasticmem-eval`` console script call ``main``;
``elasticmem.apps.ladder`` runs it with the reading ladder's variants.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from elasticmem.utils.configuration import ConfigError, print_config
from elasticmem.utils.options import command_name, parse_cli

ALIASES = ("checkpoint", "split", "system", "limit")


def _expand(argv: list[str]) -> list[str]:
    return [f"eval.{a}" if a.split("=", 1)[0] in ALIASES and "=" in a else a for a in argv]


def main(argv: list[str] | None = None) -> int:
    from elasticmem.config import Config

    argv = _expand(list(sys.argv[1:] if argv is None else argv))

    prog = command_name("evaluate.py")
    # --limit N is the config key eval.limit (an override, so the variants get it too)
    cfg, args = parse_cli(Config, argv, prog=prog, description=__doc__, flags={"eval.limit": "--limit"})
    overrides = list(args.overrides)
    from accelerate.utils import set_seed

    from elasticmem.bank import BankError
    from elasticmem.data.schema import SchemaError, load_split
    from elasticmem.data.validate import validate_examples
    from elasticmem.eval.runner import OutputDirError, evaluate
    from elasticmem.eval.streaming import stream_bank_dir, stream_order
    from elasticmem.systems import build_system
    from elasticmem.utils.configuration import load
    from elasticmem.utils.distributed import process_state

    state = process_state(timeout_s=cfg.eval.dist_timeout_s)  # one group for every variant
    main_proc = state.is_main_process
    try:
        variants = cfg.eval.variants or {cfg.eval.system: []}
        out_root = Path(cfg.eval.output_dir)
        games = None
        if cfg.eval.task == "alfworld":  # one example per game, played in the engine (elasticmem.agent.episodes)
            from elasticmem.agent.episodes import game_examples

            splits = [s.strip() for s in cfg.eval.split.split(",") if s.strip()]
            try:
                examples, games = game_examples(cfg.agent.games_dir, splits)
            except ValueError as e:  # no games folder configured, no split, or a folder without games
                raise ConfigError(str(e)) from None
        else:
            examples = load_split(cfg.data.dir, cfg.eval.split)
        if cfg.eval.limit > 0:
            examples = examples[: cfg.eval.limit]
        if main_proc:
            print_config(cfg, file=sys.stderr)
        results = {}
        for name, extra_overrides in variants.items():
            if not isinstance(extra_overrides, list) or not all(isinstance(o, str) for o in extra_overrides):
                raise ConfigError(f"eval.variants.{name} must be a list of key=value strings")
            vo = overrides + list(extra_overrides)
            vcfg = load(Config, args.config, vo) if extra_overrides else cfg
            out = out_root / name if cfg.eval.variants else out_root
            set_seed(vcfg.seed)  # untrained parts (policy, projector) start the same on every process and run
            stream = vcfg.eval.stream != "off"
            if stream and (vcfg.eval.system in ("amem", "mem0", "langmem") or games is not None):
                raise ConfigError("eval.stream builds the bank of an ElasticMem-path system (elasticmem, text_rag, "
                                  "no_memory, full_context, memgen) from the questions' histories; not for "
                                  f"{'ALFWorld games' if games is not None else vcfg.eval.system}: set eval.stream=off")
            system = build_system(vcfg, vo, device=state.device,
                                  stream_dir=stream_bank_dir(out, state.process_index) if stream else None)
            model = getattr(system, "model", None)  # A-Mem keeps its own memory: no bank to check
            # a streamed bank is filled from the examples' own histories: nothing to check it against
            validate_examples(examples, None if stream else getattr(model, "bank", None), chunking=vcfg.chunking,
                              # games carry no history: the skill bank is checked by EpisodePlayer
                              top_z=model.cfg.top_z if model is not None and games is None else 0,
                              split_name=(f"{cfg.agent.games_dir or '$ALFWORLD_DATA'} games of {cfg.eval.split}"
                                          if games is not None else f"{cfg.data.dir}/{cfg.eval.split}.jsonl"))
            meta = {"variant": name, "split": cfg.eval.split, "checkpoint": vcfg.eval.checkpoint,
                    "data_dir": cfg.agent.games_dir if games is not None else cfg.data.dir}
            kw = {"batch_size": vcfg.eval.batch_size}
            if games is not None:
                from elasticmem.agent.episodes import EpisodePlayer, episode_outcome

                system = EpisodePlayer(system, games, vcfg.agent)
                # one game per "batch": each episode is written as soon as it ends
                kw = dict(batch_size=1, scorer=episode_outcome,
                          results_options={"primary": "success_rate", "free_form": False})
            res = evaluate(system, stream_order(examples, vcfg.eval.stream) if stream else examples, out,
                           state=state, meta=meta,
                           case_studies=vcfg.eval.case_studies, plots=vcfg.eval.plots, config=vcfg,
                           settings={"split": cfg.eval.split, "seed": vcfg.seed}, overwrite=vcfg.eval.overwrite, **kw)
            del system
            if main_proc:
                from elasticmem.eval import report

                results[name] = res
                metric, acc, n, ci = report.headline(res)
                ev = res.get("evidence_retrieval")
                found = (f", evidence found {report.format_accuracy(ev['recall_any'], ev['recall_any_ci95'])} "
                         f"(chance {100 * ev['random_recall_any']:.1f} %)") if ev else ""
                print(f"{prog}: {name}: {metric} {report.format_accuracy(acc, ci, n)}, "
                      f"#Tok {res['avg_tokens']:.1f}, memory tokens {res['avg_memory_tokens']:.1f}{found}, "
                      f"{res['latency_s_per_example']:.3f} s/example -> {out}")
        if main_proc and cfg.eval.variants:
            from elasticmem.eval import plots, report

            correct = {name: report.load_correct(out_root / name / "predictions.jsonl") for name in results}
            path = report.write_comparison(results, out_root / "comparison.md",
                                           title=f"{Path(cfg.data.dir).name} / {cfg.eval.split}", correct=correct)
            plots.accuracy_vs_tokens(results, out_root / "accuracy_vs_tokens.png")
            for name, entry in json.loads(path.with_suffix(".json").read_text())["paired"].items():
                print(f"{prog}: {report.paired_line(name, entry)}")
            print(f"{prog}: comparison -> {path} and {path.with_suffix('.json')}")
            groups = report.seed_groups(list(results))
            if groups:  # variants named system@seed: the same system trained with other seeds
                seeds = report.write_seeds({g: [results[n] for n in names] for g, names in groups.items()},
                                           out_root / "seeds.md", title=f"{Path(cfg.data.dir).name} / {cfg.eval.split}"
                                           f", across training seeds")
                print(f"{prog}: across seeds -> {seeds}")
    except (ConfigError, SchemaError, BankError, FileNotFoundError, OutputDirError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
