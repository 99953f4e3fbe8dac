#include <gtest/gtest.h>

#include "numerics/numerics.h"

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(mok::num::bf16_from_float(1.0f), 0x3f80);
}
