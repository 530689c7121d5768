from llmtrain.cli import run

run()
