rule split:
    input:
        code_inputs("split.py"),
    output:
        train="results/data/train.jsonl",
        heldout="results/data/heldout.jsonl",
        stats="results/data/split_stats.json",
    log:
        "results/logs/split.log",
    conda:
        "../envs/talkmethods.yaml"
    params:
        split=tm_config.split_params(config),
    script:
        "../workflow_scripts/split.py"


rule selftest:
    input:
        code_inputs("selftest.py"),
    output:
        "results/selftest.json",
    log:
        "results/logs/selftest.log",
    conda:
        "../envs/talkmethods.yaml"
    script:
        "../workflow_scripts/selftest.py"
