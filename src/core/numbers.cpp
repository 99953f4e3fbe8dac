#include "core/numbers.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "mok/error.h"

namespace mok {

namespace {
// stoll and stod skip leading blanks but stop at trailing ones; a number is its whole text,
// so a blank on either side makes it not a number (" 5" and "5 " alike).
bool starts_with_blank(const std::string& text) {
  return !text.empty() && std::isspace(static_cast<unsigned char>(text.front()));
}
}  // namespace

long long parse_integer(const std::string& text, long long lo, long long hi, const std::string& what) {
  long long n = 0;
  try {
    std::size_t used = 0;
    if (starts_with_blank(text)) throw std::invalid_argument("leading blank");
    n = std::stoll(text, &used);
    if (used != text.size()) throw std::invalid_argument("trailing");
  } catch (const std::out_of_range&) {
    // An integer beyond 64 bits is out of range, not "not an integer" (if it is all digits).
    const std::size_t digits = text.find_first_of("+-") == 0 ? 1 : 0;
    if (text.size() > digits && text.find_first_not_of("0123456789", digits) == std::string::npos)
      throw Error(what + ": " + text + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    throw Error(what + ": '" + text + "' is not an integer");
  } catch (const std::exception&) {
    throw Error(what + ": '" + text + "' is not an integer");
  }
  if (n < lo || n > hi)
    throw Error(what + ": " + text + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return n;
}

DecimalRead read_decimal(const std::string& text, double& value) {
  if (starts_with_blank(text)) return DecimalRead::not_a_number;
  try {
    std::size_t used = 0;
    value = std::stod(text, &used);
    return used == text.size() && text.find_first_of("xX") == std::string::npos ? DecimalRead::ok
                                                                                 : DecimalRead::not_a_number;
  } catch (const std::out_of_range&) {
    return DecimalRead::out_of_range;
  } catch (const std::exception&) {
    return DecimalRead::not_a_number;
  }
}

double parse_finite(const std::string& text, const std::string& what) {
  double d = 0;
  switch (read_decimal(text, d)) {
    case DecimalRead::ok: break;
    case DecimalRead::out_of_range: throw Error(what + ": '" + text + "' is out of range");
    case DecimalRead::not_a_number: throw Error(what + ": '" + text + "' is not a number");
  }
  if (!std::isfinite(d)) throw Error(what + ": must be a finite number, got '" + text + "'");
  return d;
}

std::vector<std::string> split_fields(const std::string& text, char sep) {
  std::vector<std::string> out(1);
  for (char c : text) {
    if (c == sep)
      out.emplace_back();
    else
      out.back() += c;
  }
  return out;
}

std::string exact_number(double value) {
  char text[64];
  const auto done = std::to_chars(text, text + sizeof text, value);  // (shortest round trip)
  return std::string(text, done.ptr);
}

float to_float_in_range(double value, const std::string& what) {
  auto outside = [&] { return Error(what + ": " + exact_number(value) + " is outside float's range"); };
  // Past FLT_MAX plus half an ulp the conversion is undefined (or inf); up to it, FLT_MAX.
  constexpr double kRoundsToMax = 0x1.ffffffp127;
  if (!(std::fabs(value) < kRoundsToMax)) throw outside();  // (before converting)
  const float f = static_cast<float>(value);
  if (f == 0.0f && value != 0.0) throw outside();
  return f;
}

}  // namespace mok
