# The two set-up commands of the README. Both install what is missing first.
#   make demo   the main job on the default model (until serving lands: inspect
#               the model and tokenize a chat prompt)
#   make test   the whole test suite (what CI runs)
.PHONY: demo test build clean

build:
	deploy/install-deps.sh
	cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build -j$$(nproc)

demo: build
	build/bin/tandem inspect models/SmolLM2-135M-Instruct.Q4_1.gguf | head -18
	build/bin/tandem tokenize models/SmolLM2-135M-Instruct.Q4_1.gguf --chat "What is disaggregated serving?"

test:
	tests/run.sh

clean:
	rm -rf build build-asan build-fuzz
