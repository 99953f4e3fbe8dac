// mok: the whole public API.
#pragma once
#include "mok/config.h"
#include "mok/data.h"
#include "mok/error.h"
#include "mok/layer.h"
#include "mok/problem.h"
#include "mok/routing.h"
#include "mok/tensor.h"
