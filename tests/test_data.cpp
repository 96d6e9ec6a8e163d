// Training data: the token file reader (flat uint16 little-endian) and the synthetic corpus.
#include <cstdint>
#include <fstream>
#include <vector>

#include <gtest/gtest.h>

#include "exec/data.hpp"
#include "exec/runtime.hpp"
#include "planner/plan.hpp"
#include "test_util.hpp"

namespace pw::exec {
namespace {

using pw::testing::error_of;
using pw::testing::TempDir;

std::string write_tokens(const TempDir& dir, const std::string& name,
                         const std::vector<std::uint16_t>& tokens) {
  std::ofstream out(dir.file(name), std::ios::binary);
  for (std::uint16_t t : tokens) {
    const char bytes[2] = {char(t & 0xff), char(t >> 8)};  // little-endian on every host
    out.write(bytes, 2);
  }
  return dir.file(name);
}

// Sample i starts at token i*T (modulo the file) and its targets are the next tokens.
TEST(TokenFile, SamplesAreConsecutiveWindowsWithShiftedTargets) {
  TempDir dir("tokens");
  std::vector<std::uint16_t> tokens;
  for (int i = 0; i < 11; ++i)
    tokens.push_back(std::uint16_t(300 + i));  // above 255: the high byte matters
  const TokenSource src(write_tokens(dir, "t.bin", tokens), 1024, 1);
  std::vector<std::int32_t> in(4), target(4);
  src.sample(1, 4, in.data(), target.data());
  EXPECT_EQ(in, (std::vector<std::int32_t>{304, 305, 306, 307}));
  EXPECT_EQ(target, (std::vector<std::int32_t>{305, 306, 307, 308}));
  // Wraps around the n - 1 = 10 usable positions.
  src.sample(2, 4, in.data(), target.data());
  EXPECT_EQ(in, (std::vector<std::int32_t>{308, 309, 300, 301}));
  EXPECT_EQ(target, (std::vector<std::int32_t>{309, 310, 301, 302}));
  EXPECT_NE(src.describe().find("11 tokens"), std::string::npos);
}

TEST(TokenFile, BadFilesAreNamedErrors) {
  TempDir dir("tokens_bad");
  EXPECT_NE(error_of([&] { TokenSource(dir.file("none.bin"), 256, 1); }).find("cannot open"),
            std::string::npos);
  const std::string big = write_tokens(dir, "big.bin", {1, 2, 700, 3});
  const std::string e = error_of([&] { TokenSource(big, 256, 1); });
  EXPECT_NE(e.find(big), std::string::npos);
  EXPECT_NE(e.find("token 700 at offset 4"), std::string::npos) << e;
  std::ofstream(dir.file("odd.bin"), std::ios::binary) << "abc";
  EXPECT_NE(error_of([&] { TokenSource(dir.file("odd.bin"), 256, 1); }).find("odd size 3"),
            std::string::npos);
  const std::string one = write_tokens(dir, "one.bin", {5});
  EXPECT_NE(error_of([&] { TokenSource(one, 256, 1); }).find("fewer than 2"), std::string::npos);
}

TEST(SyntheticCorpus, IsDeterministicInSeedAndIndex) {
  const TokenSource a("", 256, 7), b("", 256, 7), c("", 256, 8);
  std::vector<std::int32_t> x(16), y(16), z(16), tx(16), ty(16), tz(16);
  a.sample(5, 16, x.data(), tx.data());
  b.sample(5, 16, y.data(), ty.data());
  c.sample(5, 16, z.data(), tz.data());
  EXPECT_EQ(x, y);
  EXPECT_EQ(tx, ty);
  EXPECT_NE(x, z);
  // Targets are the inputs shifted by one.
  for (int t = 0; t + 1 < 16; ++t)
    EXPECT_EQ(tx[std::size_t(t)], x[std::size_t(t + 1)]);
}

// Training from a token file: a repetitive text is learnt quickly, and the same file gives the
// same losses on a 2-stage pipeline as on one device (the data path feeds both ends).
TEST(TokenFile, TrainsAPipelineFromAFile) {
  TempDir dir("tokens_train");
  const std::string text = "the quick brown fox jumps over the lazy dog. ";
  std::vector<std::uint16_t> tokens;
  for (int i = 0; i < 40; ++i)
    for (char ch : text)
      tokens.push_back(std::uint16_t(static_cast<unsigned char>(ch)));
  TrainOptions o;
  o.steps = 12;
  o.lr = 3e-3f;
  o.data = write_tokens(dir, "text.bin", tokens);
  const models::ModelSpec model = models::load_model("gpt-tiny");
  planner::Plan one, two;  // the same global batch of 4: one device, or 2 stages x 2 microbatches
  one.b = 4;
  one.m = 1;
  two.b = 2;
  two.m = 2;
  two.d = 2;
  two.schedule = planner::Schedule::gpipe;
  planner::resolve_stages(one, model.layers);
  planner::resolve_stages(two, model.layers);
  const TrainResult a = train_cpu(model, one, o), b = train_cpu(model, two, o);
  EXPECT_LT(a.steps.back().loss, 0.6 * a.steps.front().loss);
  for (std::size_t i = 0; i < a.steps.size(); ++i)
    EXPECT_NEAR(a.steps[i].loss, b.steps[i].loss, 1e-4 * a.steps[i].loss) << "step " << i;
}

}  // namespace
}  // namespace pw::exec
