#include "core/numbers.h"

#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
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
  // (strtod, not stod: stod's out_of_range does not say whether the number was too large or
  // too small, and the two are refused with different rules.)
  if (text.empty() || starts_with_blank(text) || text.find_first_of("xX") != std::string::npos)
    return DecimalRead::not_a_number;
  char* end = nullptr;
  errno = 0;
  const double read = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return DecimalRead::not_a_number;  // (a NUL inside stops it too)
  if (errno == ERANGE) return std::isinf(read) ? DecimalRead::too_large : DecimalRead::too_small;
  // (Whether strtod reports an exact denormal as ERANGE is the C library's choice: judged here.)
  if (read != 0 && std::fabs(read) < std::numeric_limits<double>::min()) return DecimalRead::too_small;
  value = read;
  return DecimalRead::ok;
}

std::string out_of_double_range(const std::string& text, DecimalRead read) {
  if (read == DecimalRead::too_large)
    return "'" + text + "' is out of range (beyond double's largest magnitude, " +
           exact_number(std::numeric_limits<double>::max()) + ")";
  return "'" + text + "' is too small to read (a nonzero magnitude below double's smallest normal, " +
         exact_number(std::numeric_limits<double>::min()) + ")";
}

double parse_finite(const std::string& text, const std::string& what, const std::string& range) {
  double d = 0;
  const DecimalRead read = read_decimal(text, d);
  if (read == DecimalRead::not_a_number) throw Error(what + ": '" + text + "' is not a number");
  // (A number double cannot hold says why, and the range when there is one: 1e-310 lies inside
  // (0, 1], so "out of range" alone would not tell what to write instead.)
  if (read != DecimalRead::ok)
    throw Error(what + ": " + out_of_double_range(text, read) + (range.empty() ? "" : "; must be in " + range));
  if (!std::isfinite(d))
    throw Error(what + ": must be a finite number" + (range.empty() ? "" : " in " + range) + ", got '" + text + "'");
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
