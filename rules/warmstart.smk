# The warm start (configs with model.warmstart only): a small Qwen2 model SFT-trained on the train
# problems' ideal dialogues, the base model of every arm, of base x base and of cross-play.


rule warmstart:
    input:
        problems="results/data/train.jsonl",
        src=code_inputs("warmstart.py"),
    output:
        model=directory(f"results/{tm_config.WARMSTART_MODEL}"),
        stats="results/warmstart/stats.json",
    log:
        "results/logs/warmstart.log",
    benchmark:
        "results/benchmarks/warmstart.tsv"
    conda:
        "../envs/talkmethods.yaml"
    threads: 2
    resources:
        gpu=1,
    params:
        warmstart=tm_config.warmstart_params(config),
    script:
        "../workflow_scripts/warmstart.py"
