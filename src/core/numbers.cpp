#include "core/numbers.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "mok/error.h"

namespace mok {

long long parse_integer(const std::string& text, long long lo, long long hi, const std::string& what) {
  long long n = 0;
  try {
    std::size_t used = 0;
    n = std::stoll(text, &used);
    if (used != text.size()) throw std::invalid_argument("trailing");
  } catch (const std::exception&) {
    throw Error(what + ": '" + text + "' is not an integer");
  }
  if (n < lo || n > hi)
    throw Error(what + ": " + text + " is out of range [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return n;
}

bool not_hex(const std::string& text) { return text.find_first_of("xX") == std::string::npos; }

double parse_finite(const std::string& text, const std::string& what) {
  double d = 0;
  try {
    std::size_t used = 0;
    d = std::stod(text, &used);
    if (used != text.size() || !not_hex(text)) throw std::invalid_argument("trailing");
  } catch (const std::out_of_range&) {
    throw Error(what + ": '" + text + "' is out of range");
  } catch (const std::exception&) {
    throw Error(what + ": '" + text + "' is not a number");
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

std::string format_number(double value) {
  std::ostringstream s;
  s << value;
  return s.str();
}

}  // namespace mok
