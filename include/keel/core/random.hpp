// Randomness for jitter: a small, fast, seedable generator (xoshiro256**), a per-thread default
// instance, and BitGenRef, a non-owning reference through which any uniform random bit generator
// (std::mt19937_64, a test's fixed sequence) can be injected.
//
// Thread-safety: an Rng is not thread-safe (one per thread or per call); thread_rng() returns
// the calling thread's own generator. BitGenRef is a reference: the generator must outlive it.
//
// Example:
//   keel::Rng rng(42);                   // same seed, same jitter sequence
//   double u = keel::uniform01(rng);     // in [0, 1)
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

namespace keel {

/// xoshiro256** seeded through splitmix64. Satisfies UniformRandomBitGenerator.
class Rng {
 public:
  using result_type = std::uint64_t;
  explicit Rng(std::uint64_t seed) noexcept;

  static constexpr result_type min() noexcept { return 0; }
  static constexpr result_type max() noexcept { return std::numeric_limits<result_type>::max(); }
  result_type operator()() noexcept;

 private:
  std::uint64_t s_[4];
};

/// The calling thread's generator, seeded once per thread from random_seed().
[[nodiscard]] Rng& thread_rng() noexcept;

/// 64 bits from std::random_device: the seed of a generator that must differ between processes
/// (each process's jitter, a worker's name). Not for secrets.
[[nodiscard]] std::uint64_t random_seed();

/// A non-owning, type-erased reference to a 64-bit uniform random bit generator.
class BitGenRef {
 public:
  template <class G>
  requires(!std::is_same_v<std::remove_cvref_t<G>, BitGenRef> &&
           std::is_invocable_r_v<std::uint64_t, G&>) BitGenRef(G& gen)
  noexcept  // NOLINT(google-explicit-constructor): a reference, like absl's
      : gen_(&gen), next_([](void* g) -> std::uint64_t { return (*static_cast<G*>(g))(); }) {
    static_assert(G::min() == 0 && G::max() == std::numeric_limits<std::uint64_t>::max(),
                  "BitGenRef needs a generator of full 64-bit words");
  }
  std::uint64_t operator()() const { return next_(gen_); }

 private:
  void* gen_;
  std::uint64_t (*next_)(void*);
};

/// A double uniform on [0, 1) with 53 random bits.
[[nodiscard]] inline double uniform01(BitGenRef gen) {
  return static_cast<double>(gen() >> 11) * 0x1.0p-53;
}

}  // namespace keel
