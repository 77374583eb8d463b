# The two commands a newcomer needs: `make run` and `make test`.
# Both set everything up on first use (scripts/setup.sh).
PYTEST_ARGS ?=

.PHONY: run embed test test-unit serve image setup freeze clean

run: setup
	.venv/bin/python examples/offline_demo.py

# The embedding demo on the built-in embedding model (all-MiniLM-L6-v2).
embed: setup
	.venv/bin/python examples/embedding_demo.py

test:
	bash scripts/run_tests.sh $(PYTEST_ARGS)

# The fast part: every test not marked e2e (no engine, no server).
test-unit:
	bash scripts/run_tests.sh -m "not e2e" $(PYTEST_ARGS)

# OpenAI-compatible server on the default model, loopback only.  Spyre
# settings come from the environment; scripts/serve.sh's defaults keep
# warm-up short.
serve: setup
	bash scripts/serve.sh

# Dockerfile.spyre built here with buildah, and checked: the demo and the
# server inside the image (scripts/image.sh; docs/container.md).
image:
	bash scripts/image.sh

setup:
	bash scripts/setup.sh

# Re-pin every package after a deliberate upgrade.
freeze:
	( echo '# Every package of the environment, pinned. Regenerate with `make freeze`.'; \
	  .venv/bin/pip freeze --all | grep -v -e '^vllm' -e '^pip=' -e 'vllm.spyre.intree' | sed 's/+cpu//' | LC_ALL=C sort -f ) > constraints.txt

clean:
	rm -rf build dist *.egg-info .pytest_cache
