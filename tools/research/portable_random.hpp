#pragma once
// Random numbers for the synthetic trace generators. The standard library's
// distributions are implementation-defined; these transforms of mt19937_64
// (itself fully specified) are not, so one seed gives the same trace with any
// standard library.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace sparsekv::detail {

class PortableRandom {
 public:
  explicit PortableRandom(std::uint64_t seed) : engine_(seed) {}

  // Uniform in [0, n), unbiased (rejection of the partial top range).
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % n);
    std::uint64_t x;
    do x = engine_();
    while (x >= limit);
    return x % n;
  }
  // Uniform in [0, 1), 53 bits.
  double unit() { return double(engine_() >> 11) * 0x1.0p-53; }
  // Standard normal (Box-Muller; the second value is kept for the next call).
  double normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(1.0 - unit()));
    const double a = 6.283185307179586 * unit();
    spare_ = r * std::sin(a);
    has_spare_ = true;
    return r * std::cos(a);
  }
  // Geometric with mean `mean` >= 1, at least 1.
  std::uint32_t geometric(double mean) {
    if (mean <= 1.0) return 1;
    const double p = 1.0 / mean;
    return 1 + std::uint32_t(std::min(0x1p31, std::floor(std::log(1.0 - unit()) / std::log1p(-p))));
  }
  // Index i < n with probability (cdf[i] - cdf[i-1]) / cdf[n-1], cdf increasing.
  std::size_t pick(const std::vector<double>& cdf, std::size_t n) {
    const double u = unit() * cdf[n - 1];
    return std::min<std::size_t>(std::upper_bound(cdf.begin(), cdf.begin() + n, u) - cdf.begin(), n - 1);
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

}  // namespace sparsekv::detail
