// tests/fuzz/replay_main.cc — a driver for fuzz targets in builds without libFuzzer (gcc, CI):
// runs every input file given, then `--mutations N` deterministic mutants of each (byte
// flips, truncations, splices, integer-boundary patches). Crashes and sanitizer reports
// surface as a failed CTest. Real coverage-guided fuzzing: -DLOCKSTEP_FUZZ=ON with clang.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  long mutations = 0;
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mutations") == 0 && i + 1 < argc) {
      mutations = std::strtol(argv[++i], nullptr, 10);
    } else {
      files.push_back(argv[i]);
    }
  }
  std::mt19937_64 rng(12345);
  long runs = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "%s: cannot open\n", f.c_str());
      return 2;
    }
    std::string seed((std::istreambuf_iterator<char>(in)), {});
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(seed.data()), seed.size());
    ++runs;
    for (long m = 0; m < mutations; ++m) {
      std::string s = seed;
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits && !s.empty(); ++e) {
        const size_t at = rng() % s.size();
        switch (rng() % 6) {
          case 0: s[at] = static_cast<char>(rng()); break;
          case 1: s.resize(at); break;
          case 2: s.insert(at, s.substr(rng() % s.size(), rng() % 16)); break;
          case 3: s[at] ^= static_cast<char>(1u << (rng() % 8)); break;
          case 4: {  // an integer-looking boundary value
            static const char* kVals[] = {"0", "-1", "4294967296", "18446744073709551615", "1e308", "null", "[]"};
            s.replace(at, rng() % 4, kVals[rng() % 7]);
            break;
          }
          case 5: s.erase(at, rng() % 8); break;
        }
      }
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
      ++runs;
    }
  }
  std::printf("replayed %ld inputs without a crash\n", runs);
  return 0;
}
