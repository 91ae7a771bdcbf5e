# The two set-up commands of the README. Both install what is missing first.
#   make demo   the main job on the default model: a local cluster (tandem up:
#               etcd, router, a prefill and a decode worker), one streamed
#               generation through it, then the cluster stops
#   make test   the whole test suite (what CI runs)
.PHONY: demo test build clean

build:
	deploy/install-deps.sh
	cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build -j$$(nproc)

demo: build
	deploy/demo.sh

test:
	tests/run.sh

clean:
	rm -rf build build-asan build-tsan build-fuzz build-user build-cuda
