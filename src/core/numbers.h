// mok: whole-string numbers from command lines and files. The whole text must be the number
// (no blanks on either side), and a value out of range or not finite is an error naming `what`:
// a number is never truncated and never partly read.
#pragma once
#include <string>
#include <vector>

namespace mok {

// An integer in [lo, hi]. Errors: "<what>: '<text>' is not an integer",
// "<what>: <text> is out of range [lo, hi]".
long long parse_integer(const std::string& text, long long lo, long long hi, const std::string& what);

// A finite number, written in decimal. Errors: "<what>: '<text>' is not a number",
// "<what>: must be a finite number, got '<text>'", and for a number double cannot hold,
// "<what>: " followed by out_of_double_range's words. A caller that checks a range of its own
// afterwards gives its text (`range`, e.g. "(0, 1]"), which these errors then state: "...; must
// be in (0, 1]", "must be a finite number in (0, 1], got '-inf'".
double parse_finite(const std::string& text, const std::string& what, const std::string& range = "");

// `text` read whole as a decimal number (no blanks on either side; stod's hex forms such as
// "0x10" are not decimal), the one rule parse_finite, the command line's options and the
// routing spec's fields share; nan and inf are read (parse_finite refuses them, the callers'
// own checks judge them). A number beyond double's largest magnitude is too_large; a nonzero
// one below its smallest normal magnitude is too_small, refused rather than kept as a
// denormal (fewer digits than were written) or as 0.
enum class DecimalRead { ok, not_a_number, too_large, too_small };
DecimalRead read_decimal(const std::string& text, double& value);

// Why `text`, read as too_large or too_small, is refused, with the rule it broke:
// "'1e400' is out of range (beyond double's largest magnitude, 1.7976931348623157e+308)" or
// "'1e-310' is too small to read (a nonzero magnitude below double's smallest normal,
// 2.2250738585072014e-308)". Callers add the range their value must be in.
std::string out_of_double_range(const std::string& text, DecimalRead read);

// `value` (finite) as a float. One beyond float's range, which the conversion would make inf
// or 0 (or, past FLT_MAX, leave undefined), is an error "<what>: <value> is outside float's
// range": refused as written, never judged as what it would have become.
float to_float_in_range(double value, const std::string& what);

// The shortest decimal text that reads back as exactly `value` (1.2, 0.25, 1e-50,
// 1.0000001): what a spec records so that parsing it again gives the same run, and how error
// messages and describe() write a number (not std::to_string's six fixed decimals, which print
// 1e-50 as 0.000000, nor a stream's six significant digits, which print 1.0000001 as 1 and so
// a refused value as a valid one).
std::string exact_number(double value);

// The fields of `text` between `sep`s, empty ones included ("a,,b" is three fields, "" is
// one): whoever parses the list decides that an empty field is an error, never the splitter.
std::vector<std::string> split_fields(const std::string& text, char sep);

}  // namespace mok
