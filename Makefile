# The two set-up commands of the README. Both install what is missing first.
#   make demo   the main job on the default model (until serving lands:
#               tandem generate in this process)
#   make test   the whole test suite (what CI runs)
.PHONY: demo test build clean

build:
	deploy/install-deps.sh
	cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build -j$$(nproc)

demo: build
	build/bin/tandem generate --chat --max-tokens 96 "Explain in two sentences why the sky is blue."

test:
	tests/run.sh

clean:
	rm -rf build build-asan build-fuzz
