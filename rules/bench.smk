# `snakemake -j1 bench`: the speed benchmark (not part of `all`): the fast rollout engine against plain
# generate, a few real steps of every arm, a 600-chat eval batch and the projected recipe wall-clock.


rule bench:
    input:
        script=os.path.join(workflow.basedir, "bench", "speed.py"),
        src=package_src(
            "engines/__init__",
            "engines/sampling",
            "engines/plain",
            "engines/loop",
            "engines/fast/__init__",
            "engines/fast/weights",
            "engines/fast/qwen2",
            "engines/fast/generator",
            "engines/fast/attention",
            "engines/fast/sampler",
            "rollout",
            "training/__init__",
            "training/build",
            "training/trainer",
            "training/rows",
            "training/patches",
            "training/runs",
            "evaluate",
            "models",
        ),
    output:
        json="results/bench/speed.json",
        table="results/bench/speed.md",
    log:
        "results/logs/bench.log",
    conda:
        "../envs/talkmethods.yaml"
    resources:
        gpu=1,
    params:
        model=config.get("bench", {}).get("model", "random:qwen2.5-1.5b"),
        quick=config.get("bench", {}).get("quick", False),
    script:
        "../workflow_scripts/bench.py"
