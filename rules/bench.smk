# `snakemake -j1 bench`: the speed benchmark (not part of `all`): the fast rollout engine against plain
# generate, a few real steps of every arm, a 600-chat eval batch and the projected recipe wall-clock.


rule bench:
    input:
        script=os.path.join(workflow.basedir, "bench", "speed.py"),
        src=code_inputs("bench.py", os.path.join(workflow.basedir, "bench", "speed.py")),
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
        model=config["bench"]["model"],
        quick=config["bench"]["quick"],
    script:
        "../workflow_scripts/bench.py"
