"""Agentic memory on ALFWorld (the paper's second setting): the real engine behind a small
adapter (``alfworld_env``), the expert trajectories that memories and imitation come from
(``trajectories``), the skill cards distilled from them (``skill_cards``) and the per-step
imitation examples the GRPO trainer runs on (``imitation``), and solvable games generated in the
scene of a real trial (``generate_games``). The engine needs the agent extra:
``pip install 'elasticmem[agent]'``. See docs/alfworld.md."""
