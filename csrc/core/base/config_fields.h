// Kernel configs from one field list per op.
//
// An op writes its Config's knobs once, as an X-macro of
//   X(name, default_value, min, max, multiple_of, "what it means")
// and its products (the calls that are configured and tuned separately) as an X-macro of
//   X(kEnumerator, "name")
// then declares the struct with TOKAMAX_CONFIG_BODY (line continuations left out here):
//
//   #define TOKAMAX_MY_OP_CONFIG_FIELDS(X)
//     X(block_m, 96, 1, 4096, 1, "rows per task") X(block_n, 256, 8, 8192, 8, "columns per tile")
//   #define TOKAMAX_MY_OP_PRODUCTS(X) X(kForward, "forward") X(kBackward, "backward")
//   struct MyOpConfig {
//     TOKAMAX_CONFIG_BODY(MyOpConfig, "my_op", TOKAMAX_MY_OP_CONFIG_FIELDS, TOKAMAX_MY_OP_PRODUCTS)
//   };
//   Status MyOpConfig::ValidateCrossFields() const { ... }  // rules that tie fields together
//
// That gives the members with their defaults, kFields (name, bounds, doc), the Product enum and
// kProductNames, ToVector / FromVector (the int[] the schema carries, in field order), equality,
// and Validate(): every field's bounds (the error names the field, the expected range and the
// value got), then the op's hand-written ValidateCrossFields(). The torch adapter
// (csrc/torch/op_kit.h) and the Python Config dataclasses are built from the same list.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/core/base/status.h"

namespace tokamax {

// One knob of a Config as its field list declares it.
struct ConfigField {
  const char* name;
  int64_t default_value;
  int64_t min;
  int64_t max;
  int64_t multiple_of;  // 1: any integer in [min, max]
  const char* doc;
};

// "in [1, 8192]" or "a multiple of 16 in [16, 8192]".
inline std::string ConfigFieldRange(const ConfigField& field) {
  std::string range = "in [" + std::to_string(field.min) + ", " + std::to_string(field.max) + "]";
  if (field.multiple_of > 1) range = "a multiple of " + std::to_string(field.multiple_of) + " " + range;
  return range;
}

// The error every config check reports: "<op> config: <what> must be <expected>, got <value>".
inline Status ConfigError(const char* op, const std::string& what, const std::string& expected, int64_t got) {
  return Status::Error(std::string(op) + " config: " + what + " must be " + expected + ", got " +
                       std::to_string(got));
}

inline Status CheckConfigField(const char* op, const ConfigField& field, int64_t value) {
  const bool in_range = value >= field.min && value <= field.max;
  if (in_range && (field.multiple_of <= 1 || value % field.multiple_of == 0)) return Status::Ok();
  return ConfigError(op, field.name, ConfigFieldRange(field), value);
}

constexpr bool ConfigNamesEqual(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}

// A field's declaration by name, at compile time (an unknown name does not compile), e.g. to
// tie a field's bounds to a kernel constant with static_assert.
template <typename Config>
constexpr const ConfigField& ConfigFieldNamed(const char* name) {
  for (const ConfigField& field : Config::kFields) {
    if (ConfigNamesEqual(field.name, name)) return field;
  }
  throw "no such config field";
}

template <typename Config>
std::vector<int64_t> ConfigToVector(const Config& config) {
  std::vector<int64_t> values;
  values.reserve(Config::kNumFields);
  Config::ForEachField(config, [&](const ConfigField&, int64_t value) { values.push_back(value); });
  return values;
}

// Every field's own bounds, in field order; the first violation is reported.
template <typename Config>
Status CheckConfigFields(const Config& config) {
  Status status;
  Config::ForEachField(config, [&](const ConfigField& field, int64_t value) {
    if (status.ok()) status = CheckConfigField(Config::kOpName, field, value);
  });
  return status;
}

// `values` in field order: exactly kNumFields of them, each within its bounds, and the cross-field
// rules. `*config` is written only when all hold.
template <typename Config>
Status ConfigFromVector(const std::vector<int64_t>& values, Config* config) {
  if (values.size() != static_cast<size_t>(Config::kNumFields)) {
    std::string names;
    for (const ConfigField& field : Config::kFields) names += (names.empty() ? "" : ", ") + std::string(field.name);
    return Status::Error(std::string(Config::kOpName) + " config: expected " + std::to_string(Config::kNumFields) +
                         " values (" + names + "), got " + std::to_string(values.size()));
  }
  Config parsed;
  size_t index = 0;
  Config::ForEachField(parsed, [&](const ConfigField&, int64_t& value) { value = values[index++]; });
  const Status status = parsed.Validate();
  if (!status.ok()) return status;
  *config = parsed;
  return Status::Ok();
}

template <typename Config>
bool ConfigsEqual(const Config& a, const Config& b) {
  return ConfigToVector(a) == ConfigToVector(b);
}

}  // namespace tokamax

// ---- the macros a Config struct is written with -------------------------------------------------

#define TOKAMAX_CONFIG_MEMBER_(name, default_value, min, max, multiple_of, doc) int64_t name = default_value;
#define TOKAMAX_CONFIG_FIELD_(name, default_value, min, max, multiple_of, doc) \
  ::tokamax::ConfigField{#name, default_value, min, max, multiple_of, doc},
#define TOKAMAX_CONFIG_VISIT_(name, ...) visit(kFields[index++], self.name);
#define TOKAMAX_CONFIG_COUNT_(...) +1
#define TOKAMAX_CONFIG_PRODUCT_ENUM_(enumerator, name) enumerator,
#define TOKAMAX_CONFIG_PRODUCT_NAME_(enumerator, name) name,

// The body of a Config struct named `Type` of op `op_name` (see the top of this file).
#define TOKAMAX_CONFIG_BODY(Type, op_name, FIELDS, PRODUCTS)                                          \
  FIELDS(TOKAMAX_CONFIG_MEMBER_)                                                                      \
                                                                                                      \
  static constexpr const char* kOpName = op_name;                                                     \
  static constexpr int kNumFields = 0 FIELDS(TOKAMAX_CONFIG_COUNT_);                                  \
  static constexpr std::array<::tokamax::ConfigField, kNumFields> kFields = {{FIELDS(TOKAMAX_CONFIG_FIELD_)}}; \
  enum class Product : int { PRODUCTS(TOKAMAX_CONFIG_PRODUCT_ENUM_) };                               \
  static constexpr int kNumProducts = 0 PRODUCTS(TOKAMAX_CONFIG_COUNT_);                              \
  static constexpr std::array<const char*, kNumProducts> kProductNames = {{PRODUCTS(TOKAMAX_CONFIG_PRODUCT_NAME_)}}; \
                                                                                                      \
  /* Calls visit(const ConfigField&, value) for each field in order; `self` may be const. */          \
  template <typename Self, typename Visitor>                                                          \
  static void ForEachField(Self& self, Visitor&& visit) {                                             \
    size_t index = 0;                                                                                 \
    FIELDS(TOKAMAX_CONFIG_VISIT_)                                                                     \
    (void)index;                                                                                      \
  }                                                                                                   \
  /* Each field's bounds, then the op's cross-field rules. */                                         \
  ::tokamax::Status Validate() const {                                                                \
    const ::tokamax::Status fields = ::tokamax::CheckConfigFields(*this);                             \
    return fields.ok() ? ValidateCrossFields() : fields;                                              \
  }                                                                                                   \
  /* Written by the op: the rules that tie fields together (Ok when there are none). */               \
  ::tokamax::Status ValidateCrossFields() const;                                                      \
  std::vector<int64_t> ToVector() const { return ::tokamax::ConfigToVector(*this); }                  \
  static ::tokamax::Status FromVector(const std::vector<int64_t>& values, Type* config) {             \
    return ::tokamax::ConfigFromVector(values, config);                                               \
  }                                                                                                   \
  bool operator==(const Type& other) const { return ::tokamax::ConfigsEqual(*this, other); }         \
  bool operator!=(const Type& other) const { return !(*this == other); }
