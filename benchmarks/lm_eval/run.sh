#!/usr/bin/env bash
# lm-eval's local-completions against `treadle serve` (default model): a loglikelihood
# (multiple-choice) task end to end, on 10 questions shipped here (no dataset is downloaded).
# lm-eval goes into its own venv ($LM_EVAL_VENV, default .lm-eval-venv): its dependencies are
# many and none of treadle's tests need them. Usage: benchmarks/lm_eval/run.sh [TREADLE_BIN_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${1:-$here/../../.venv/bin}
venv=${LM_EVAL_VENV:-$here/../../.lm-eval-venv}
if [ ! -x "$venv/bin/lm-eval" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "lm-eval[api]==0.4.13" transformers tokenizers
fi
work=$(mktemp -d)
port=$("$bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$work/capitals.yaml" <<YAML
task: treadle_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: $here/capitals.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{country}}?\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
YAML
# The tokenizer lm-eval counts context tokens with: the default model's, as treadle saved it.
"$bin/python" -c '
from treadle.config import resolve_model
from treadle.tokenizer import load_tokenizer
load_tokenizer(resolve_model(None)).save_pretrained("'"$work"'/tokenizer")'
"$bin/treadle" serve --port "$port" --max-model-len 512 > "$work/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$venv/bin/lm-eval" run --model local-completions \
    --tasks treadle_capitals --include_path "$work" \
    --model_args "base_url=http://127.0.0.1:$port/v1/completions,model=SmolLM2-135M-Instruct,tokenizer_backend=huggingface,tokenizer=$work/tokenizer,tokenized_requests=True,num_concurrent=4,max_retries=1"
