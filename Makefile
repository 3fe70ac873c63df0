# The two commands a newcomer needs: `make demo` and `make test`.
# Both install what is missing (scripts/bootstrap.sh), configure and build first.
.PHONY: all bootstrap bootstrap-test build demo test sanitize asan tsan bench format clean

JOBS ?= $(shell nproc 2>/dev/null || echo 2)

all: build

bootstrap:
	@scripts/bootstrap.sh

bootstrap-test:
	@scripts/bootstrap.sh --test

build: bootstrap
	cmake --preset release
	cmake --build --preset release -j$(JOBS)

# Only what scripts/demo.sh runs (keel and keel-demo), not the tests and benchmarks.
demo: bootstrap
	cmake --preset release
	cmake --build --preset release -j$(JOBS) --target keel keel-demo
	scripts/demo.sh

test: bootstrap-test
	cmake --preset release
	cmake --build --preset release -j$(JOBS)
	ctest --preset release -j$(JOBS)

sanitize: asan tsan

asan: bootstrap-test
	cmake --preset asan
	cmake --build --preset asan -j$(JOBS)
	ctest --preset asan -j$(JOBS)

# cpp-httplib compiled with -fsanitize=thread: Debian's source of the installed version.
tsan: bootstrap-test
	scripts/httplib-source.sh build-tsan/_deps/cpp-httplib
	cmake --preset tsan
	cmake --build --preset tsan -j$(JOBS)
	ctest --preset tsan -j$(JOBS)

bench: build
	scripts/bench.sh

format:
	git ls-files '*.cpp' '*.hpp' | xargs clang-format -i

clean:
	rm -rf build build-dev build-asan build-tsan
