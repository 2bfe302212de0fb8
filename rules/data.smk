rule split:
    input:
        package_src("problems", "split", "synthetic", "stages"),
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
        package_src(
            "selftest",
            "split",
            "grading",
            "rollout",
            "engines/__init__",
            "engines/sampling",
            "engines/plain",
            "engines/loop",
            "credit",
            "models",
            "dialogue",
        ),
    output:
        "results/selftest.json",
    log:
        "results/logs/selftest.log",
    conda:
        "../envs/talkmethods.yaml"
    script:
        "../workflow_scripts/selftest.py"
