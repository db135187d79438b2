// The generic config machinery, on a toy Config written the way every op writes its own.
#include "csrc/core/base/config_fields.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tokamax {
namespace {

#define TOKAMAX_TOY_CONFIG_FIELDS(X)          \
  X(rows, 12, 1, 96, 1, "rows per task")       \
  X(cols, 32, 16, 256, 16, "columns per tile") \
  X(depth, 0, 0, 8, 1, "how deep to look")
#define TOKAMAX_TOY_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")

struct ToyConfig {
  TOKAMAX_CONFIG_BODY(ToyConfig, "toy", TOKAMAX_TOY_CONFIG_FIELDS, TOKAMAX_TOY_PRODUCTS)
};

Status ToyConfig::ValidateCrossFields() const {
  if (rows * cols > 2048) return ConfigError(kOpName, "rows * cols", "at most 2048", rows * cols);
  return Status::Ok();
}

static_assert(ToyConfig::kNumFields == 3, "one field per X");
static_assert(ToyConfig::kNumProducts == 2, "one product per X");
static_assert(ConfigFieldNamed<ToyConfig>("cols").multiple_of == 16, "lookup by name at compile time");
static_assert(static_cast<int>(ToyConfig::Product::kBackward) == 1, "products are numbered in list order");

TEST(ConfigFieldsTest, TheListGivesMembersDefaultsNamesAndProducts) {
  const ToyConfig config;
  EXPECT_EQ(config.rows, 12);
  EXPECT_EQ(config.cols, 32);
  EXPECT_EQ(config.depth, 0);
  std::vector<std::string> names;
  for (const ConfigField& field : ToyConfig::kFields) names.push_back(field.name);
  EXPECT_EQ(names, (std::vector<std::string>{"rows", "cols", "depth"}));
  EXPECT_STREQ(ToyConfig::kFields[1].doc, "columns per tile");
  EXPECT_STREQ(ToyConfig::kProductNames[0], "forward");
  EXPECT_STREQ(ToyConfig::kProductNames[1], "backward");
  EXPECT_TRUE(config.Validate().ok()) << config.Validate().message();
}

TEST(ConfigFieldsTest, RoundTripsThroughTheIntList) {
  ToyConfig config;
  config.rows = 7;
  config.cols = 48;
  config.depth = 8;
  EXPECT_EQ(config.ToVector(), (std::vector<int64_t>{7, 48, 8}));
  ToyConfig parsed;
  ASSERT_TRUE(ToyConfig::FromVector(config.ToVector(), &parsed).ok());
  EXPECT_EQ(parsed, config);
  EXPECT_EQ(parsed.rows, 7);
  EXPECT_EQ(parsed.cols, 48);
  EXPECT_EQ(parsed.depth, 8);
}

TEST(ConfigFieldsTest, EqualityComparesEveryField) {
  ToyConfig a, b;
  EXPECT_TRUE(a == b);
  b.depth = 1;  // the last field too
  EXPECT_FALSE(a == b);
  EXPECT_TRUE(a != b);
  b = a;
  b.rows = 13;
  EXPECT_NE(a, b);
}

TEST(ConfigFieldsTest, BoundsErrorsNameTheFieldTheRangeAndTheValue) {
  ToyConfig config;
  config.cols = 20;
  EXPECT_EQ(config.Validate().message(), "toy config: cols must be a multiple of 16 in [16, 256], got 20");
  config.cols = 272;
  EXPECT_EQ(config.Validate().message(), "toy config: cols must be a multiple of 16 in [16, 256], got 272");
  config = ToyConfig();
  config.rows = 0;
  EXPECT_EQ(config.Validate().message(), "toy config: rows must be in [1, 96], got 0");
  config = ToyConfig();
  config.depth = -1;
  EXPECT_EQ(config.Validate().message(), "toy config: depth must be in [0, 8], got -1");
  // Each bound is inclusive.
  config.depth = 8;
  config.rows = 1;
  config.cols = 256;
  EXPECT_TRUE(config.Validate().ok()) << config.Validate().message();
}

TEST(ConfigFieldsTest, TheFirstBadFieldIsReported) {
  ToyConfig config;
  config.cols = 17;
  config.depth = 99;
  EXPECT_NE(config.Validate().message().find("cols"), std::string::npos) << config.Validate().message();
}

TEST(ConfigFieldsTest, CrossFieldRulesRunAfterTheFieldBounds) {
  ToyConfig config;
  config.rows = 96;
  config.cols = 256;  // each in range, the product is not
  EXPECT_EQ(config.Validate().message(), "toy config: rows * cols must be at most 2048, got 24576");
  config.rows = 0;  // a bad field is reported before the cross-field rule
  EXPECT_EQ(config.Validate().message(), "toy config: rows must be in [1, 96], got 0");
}

TEST(ConfigFieldsTest, FromVectorRejectsWrongCountsAndBadValuesWithoutWriting) {
  ToyConfig config;
  config.rows = 3;
  const ToyConfig before = config;
  const Status short_list = ToyConfig::FromVector({1, 16}, &config);
  EXPECT_EQ(short_list.message(), "toy config: expected 3 values (rows, cols, depth), got 2");
  EXPECT_EQ(ToyConfig::FromVector({1, 16, 0, 0}, &config).message(),
            "toy config: expected 3 values (rows, cols, depth), got 4");
  EXPECT_EQ(ToyConfig::FromVector({1, 16, 9}, &config).message(), "toy config: depth must be in [0, 8], got 9");
  EXPECT_FALSE(ToyConfig::FromVector({96, 256, 0}, &config).ok());  // the cross-field rule
  EXPECT_EQ(config, before);
}

TEST(ConfigFieldsTest, RangeText) {
  EXPECT_EQ(ConfigFieldRange(ConfigFieldNamed<ToyConfig>("rows")), "in [1, 96]");
  EXPECT_EQ(ConfigFieldRange(ConfigFieldNamed<ToyConfig>("cols")), "a multiple of 16 in [16, 256]");
}

}  // namespace
}  // namespace tokamax
