# The two commands a newcomer needs: `make run` and `make test`.
# Both set everything up on first use (scripts/setup.sh).
PYTEST_ARGS ?=

.PHONY: run test serve setup freeze clean

run: setup
	.venv/bin/python examples/offline_demo.py

test:
	bash scripts/run_tests.sh $(PYTEST_ARGS)

# OpenAI-compatible server on the default model, loopback only.  Spyre
# settings come from the environment; these defaults keep warm-up short.
serve: setup
	VLLM_SPYRE_DYNAMO_BACKEND=$${VLLM_SPYRE_DYNAMO_BACKEND:-eager} \
	VLLM_SPYRE_WARMUP_PROMPT_LENS=$${VLLM_SPYRE_WARMUP_PROMPT_LENS:-128} \
	VLLM_SPYRE_WARMUP_NEW_TOKENS=$${VLLM_SPYRE_WARMUP_NEW_TOKENS:-64} \
	VLLM_SPYRE_WARMUP_BATCH_SIZES=$${VLLM_SPYRE_WARMUP_BATCH_SIZES:-4} \
	VLLM_RPC_TIMEOUT=$${VLLM_RPC_TIMEOUT:-3000} \
	.venv/bin/vllm serve models/SmolLM2-135M-Instruct --host 127.0.0.1 --port $${PORT:-8000}

setup:
	bash scripts/setup.sh

# Re-pin every package after a deliberate upgrade.
freeze:
	( echo '# Every package of the environment, pinned. Regenerate with `make freeze`.'; \
	  .venv/bin/pip freeze --all | grep -v -e '^vllm' -e '^pip=' -e 'vllm.spyre.intree' | sed 's/+cpu//' | sort ) > constraints.txt

clean:
	rm -rf build dist *.egg-info .pytest_cache
