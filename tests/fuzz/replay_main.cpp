// Plain (non-libFuzzer) driver for the fuzz targets, built with the normal compiler so the
// committed corpus is replayed by CTest in every build (zstd's regression_driver.c idea).
//
//   fuzz_<target>_replay [--mutate=K] [--random=N] [--seed=S] PATH...
//
// Every regular file under each PATH (a file or a directory, sorted by name) is passed to
// LLVMFuzzerTestOneInput. --mutate=K also runs K byte-level mutations of each file and
// --random=N runs N pseudo-random inputs (deterministic for a given --seed): a cheap fuzz
// smoke test on machines without clang. A target reports a violated invariant by
// aborting, so a non-zero exit or a signal is a failure. Finding no input at all is an
// error too, so a missing corpus cannot pass silently.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
extern "C" int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

namespace {

std::vector<uint8_t> read_file(const std::filesystem::path &p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void run_one(const std::vector<uint8_t> &bytes) {
  // Copy into an exact-size heap buffer so ASan sees reads past the end of the input.
  std::unique_ptr<uint8_t[]> buf(new uint8_t[bytes.empty() ? 1 : bytes.size()]);
  if (!bytes.empty()) std::memcpy(buf.get(), bytes.data(), bytes.size());
  LLVMFuzzerTestOneInput(buf.get(), bytes.size());
}

}  // namespace

int main(int argc, char **argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  unsigned long mutate = 0, random_inputs = 0, seed = 1;
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--mutate=", 0) == 0) {
      mutate = std::strtoul(arg.c_str() + 9, nullptr, 10);
    } else if (arg.rfind("--random=", 0) == 0) {
      random_inputs = std::strtoul(arg.c_str() + 9, nullptr, 10);
    } else if (arg.rfind("--seed=", 0) == 0) {
      seed = std::strtoul(arg.c_str() + 7, nullptr, 10);
    } else if (std::filesystem::is_directory(arg)) {
      std::vector<std::filesystem::path> in_dir;
      for (const auto &e : std::filesystem::recursive_directory_iterator(arg))
        if (e.is_regular_file()) in_dir.push_back(e.path());
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else if (std::filesystem::is_regular_file(arg)) {
      files.emplace_back(arg);
    } else {
      std::fprintf(stderr, "%s: no such file or directory: %s\n", argv[0], arg.c_str());
      return 2;
    }
  }
  if (files.empty() && random_inputs == 0) {
    std::fprintf(stderr, "%s: no input files found (pass the corpus directory)\n", argv[0]);
    return 2;
  }

  std::mt19937_64 rng(seed);
  size_t runs = 0, bytes_total = 0;
  for (const auto &path : files) {
    const std::vector<uint8_t> bytes = read_file(path);
    run_one(bytes);
    ++runs;
    bytes_total += bytes.size();
    for (unsigned long m = 0; m < mutate; ++m) {
      // A few random byte edits, sometimes a truncation or an extension.
      std::vector<uint8_t> v = bytes;
      const unsigned edits = 1 + static_cast<unsigned>(rng() % 4);
      for (unsigned e = 0; e < edits && !v.empty(); ++e) v[rng() % v.size()] = static_cast<uint8_t>(rng());
      if (rng() % 4 == 0 && !v.empty()) v.resize(rng() % v.size());
      if (rng() % 4 == 0)
        for (unsigned e = static_cast<unsigned>(rng() % 16); e-- > 0;) v.push_back(static_cast<uint8_t>(rng()));
      run_one(v);
      ++runs;
    }
  }
  for (unsigned long r = 0; r < random_inputs; ++r) {
    std::vector<uint8_t> v(rng() % 512);
    for (uint8_t &b : v) b = static_cast<uint8_t>(rng());
    run_one(v);
    ++runs;
  }
  std::printf("%s: %zu inputs run (%zu corpus files, %zu corpus bytes), all invariants held\n",
              argv[0], runs, files.size(), bytes_total);
  return 0;
}
