// mok's C interface (include/mok/c_api.h): plain structs in, mok::Layer calls, a status out.
// What must stay true: no exception crosses into C (every entry point catches), and each
// enum value here is the C++ enum's (checked below at compile time).
#include "mok/c_api.h"

#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "capi/c_structs.h"
#include "core/validate.h"
#include "mok/mok.h"

static_assert(MOK_BF16 == static_cast<int>(mok::DType::bf16) && MOK_F32 == static_cast<int>(mok::DType::f32) &&
              MOK_I32 == static_cast<int>(mok::DType::i32) && MOK_I64 == static_cast<int>(mok::DType::i64) &&
              MOK_E4M3 == static_cast<int>(mok::DType::e4m3) && MOK_E8M0 == static_cast<int>(mok::DType::e8m0));
static_assert(MOK_CPU == static_cast<int>(mok::Device::cpu) && MOK_CUDA == static_cast<int>(mok::Device::cuda));
static_assert(MOK_PRECISION_BF16 == static_cast<int>(mok::Precision::bf16) &&
              MOK_PRECISION_MXFP8 == static_cast<int>(mok::Precision::mxfp8));
static_assert(MOK_BACKEND_CPU == static_cast<int>(mok::Backend::cpu) &&
              MOK_BACKEND_CUDA == static_cast<int>(mok::Backend::cuda));
static_assert(MOK_ALL_RANKS == static_cast<int>(mok::EpMode::all_ranks) &&
              MOK_RANK_SLICE == static_cast<int>(mok::EpMode::rank_slice) &&
              MOK_DISTRIBUTED == static_cast<int>(mok::EpMode::distributed));
static_assert(MOK_C_MAX_DIMS == mok::kMaxTensorDims);

struct mok_layer {
  mok::Layer layer;
};

namespace mok::capi {

mok_tensor c_tensor(const TensorView& v) {
  mok_tensor t{};
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.device = static_cast<int32_t>(v.device);
  t.device_index = v.device_index;
  t.ndim = v.ndim;
  for (int d = 0; d < v.ndim; ++d) {
    t.shape[d] = v.shape[d];
    t.strides[d] = v.strides[d];
  }
  return t;
}

mok_problem c_problem(const Problem& p) {
  mok_problem c{};
  c.num_experts = p.num_experts;
  c.hidden = p.hidden;
  c.intermediate = p.intermediate;
  c.top_k = p.top_k;
  c.ep_size = p.ep_size;
  c.tokens_per_rank = p.tokens_per_rank;
  c.precision = static_cast<int32_t>(p.precision);
  c.num_shared = p.num_shared();
  for (int s = 0; s < p.num_shared(); ++s) c.shared_intermediate[s] = p.shared_intermediate[s];
  c.has_swiglu_limit = p.swiglu_limit.has_value() ? 1 : 0;
  c.swiglu_limit = p.swiglu_limit.value_or(0.0f);
  return c;
}

}  // namespace mok::capi

namespace {

thread_local std::string last_error;

// Keeping the message may itself fail (out of memory): then a fixed one is kept instead.
void set_last_error(const char* what) noexcept {
  try {
    last_error = what;
  } catch (...) {
    last_error.clear();  // (never throws; c_str() below then says nothing rather than crash)
  }
}

// Runs `body`, turning what it throws into a status and this thread's last error.
template <typename Body>
int guarded(Body&& body) noexcept {
  try {
    body();
    return MOK_OK;
  } catch (const mok::PeerWaitError& e) {
    set_last_error(e.what());
    return MOK_PEER_WAIT_ERROR;
  } catch (const std::bad_alloc&) {  // (what() is only "std::bad_alloc": say what ran out)
    set_last_error("out of host memory (std::bad_alloc): this call's host allocations (the CPU backend's slots "
                   "and work, a problem's tensors) need more than the process may allocate; a smaller problem "
                   "or fewer tokens per rank needs less");
    return MOK_ERROR;
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return MOK_ERROR;
  } catch (...) {
    set_last_error("mok: an unknown exception");
    return MOK_ERROR;
  }
}

template <typename Enum>
Enum checked_enum(int32_t value, int32_t count, const std::string& name) {
  mok::require(value >= 0 && value < count, name + " = " + std::to_string(value) + ": must be in [0, " +
                                                std::to_string(count) + ")");
  return static_cast<Enum>(value);
}

// A C switch: 0 or 1 (a 7 or a -1 is more likely an uninitialised field than a yes).
bool checked_flag(int32_t value, const std::string& name) {
  mok::require(value == 0 || value == 1, name + " = " + std::to_string(value) + ": must be 0 or 1");
  return value == 1;
}

void require_not_null(const void* p, const char* name) {
  mok::require(p != nullptr, std::string(name) + ": must not be NULL");
}

mok::TensorView view(const mok_tensor& t, const std::string& name) {
  mok::TensorView v;
  if (t.data == nullptr) return v;
  v.data = t.data;
  v.dtype = checked_enum<mok::DType>(t.dtype, MOK_E8M0 + 1, name + ".dtype");
  v.device = checked_enum<mok::Device>(t.device, MOK_CUDA + 1, name + ".device");
  mok::require(t.device_index >= 0, name + ".device_index = " + std::to_string(t.device_index) + ": must be >= 0");
  // (A cpu tensor has no device index: any other value would be accepted and ignored.)
  mok::require(v.device == mok::Device::cuda || t.device_index == 0,
               name + ".device_index = " + std::to_string(t.device_index) + ": must be 0 for a cpu tensor");
  v.device_index = t.device_index;
  mok::require(t.ndim >= 0 && t.ndim <= MOK_C_MAX_DIMS,
               name + ".ndim = " + std::to_string(t.ndim) + ": must be in [0, " + std::to_string(MOK_C_MAX_DIMS) + "]");
  v.ndim = t.ndim;
  for (int d = 0; d < t.ndim; ++d) {
    v.shape[d] = t.shape[d];
    v.strides[d] = t.strides[d];
  }
  return v;
}

int32_t shared_count(int32_t n, const std::string& name) {
  mok::require(n >= 0 && n <= MOK_C_MAX_SHARED,
               name + " = " + std::to_string(n) + ": must be in [0, " + std::to_string(MOK_C_MAX_SHARED) + "]");
  return n;
}

// A rank's `a.num_shared` shared-expert triples (weights: SharedExpertWeights; gradients:
// SharedExpertGrads, the same three views), named `name`[s].w_gate and so on.
template <typename Triple, typename CRank>
std::vector<Triple> shared_triples(const CRank& a, const mok_shared_weights* shared, const std::string& rank,
                                   const std::string& name) {
  std::vector<Triple> out;
  for (int s = 0; s < shared_count(a.num_shared, rank + ".num_shared"); ++s) {
    const std::string n = name + "[" + std::to_string(s) + "]";
    out.push_back({view(shared[s].w_gate, n + ".w_gate"), view(shared[s].w_up, n + ".w_up"),
                   view(shared[s].w_down, n + ".w_down")});
  }
  return out;
}

// What mok_rank_forward and mok_rank_backward share: the rank's inputs and weights.
template <typename CRank>
mok::RankInputs inputs_of(const CRank& a, const std::string& n) {
  return {view(a.x, n + ".x"), view(a.top_experts, n + ".top_experts"), view(a.router_weights, n + ".router_weights")};
}

template <typename CRank>
mok::RankWeights weights_of(const CRank& a, const std::string& n) {
  return {view(a.w_gate, n + ".w_gate"), view(a.w_up, n + ".w_up"), view(a.w_down, n + ".w_down"),
          shared_triples<mok::SharedExpertWeights>(a, a.shared, n, n + ".shared")};
}

// The inverse of capi::c_problem, checking what C's types cannot: the enum, the flag and the
// shared count (the Problem's own rules are the Layer's to check).
mok::Problem problem_from(const mok_problem& c) {
  mok::Problem p;
  p.num_experts = c.num_experts;
  p.hidden = c.hidden;
  p.intermediate = c.intermediate;
  p.top_k = c.top_k;
  p.ep_size = c.ep_size;
  p.tokens_per_rank = c.tokens_per_rank;
  p.precision = checked_enum<mok::Precision>(c.precision, MOK_PRECISION_MXFP8 + 1, "problem.precision");
  const int shared = shared_count(c.num_shared, "problem.num_shared");
  p.shared_intermediate.assign(c.shared_intermediate, c.shared_intermediate + shared);
  if (checked_flag(c.has_swiglu_limit, "problem.has_swiglu_limit")) p.swiglu_limit = c.swiglu_limit;
  return p;
}

mok::Config config_from(const mok_config& c) {
  mok::Config config;
  config.minibatch_rows = c.minibatch_rows;
  config.macrobatch_rows = c.macrobatch_rows;
  config.schedule_capacity_factor = c.schedule_capacity_factor;
  config.forward_comm_sms = c.forward_comm_sms;
  config.backward_comm_sms = c.backward_comm_sms;
  config.tile_rows = c.tile_rows;
  config.task_band_tiles = c.task_band_tiles;
  config.task_pairs = checked_flag(c.task_pairs, "config.task_pairs");
  return config;
}

void config_to(const mok::Config& config, mok_config* c) {
  c->minibatch_rows = config.minibatch_rows;
  c->macrobatch_rows = config.macrobatch_rows;
  c->schedule_capacity_factor = config.schedule_capacity_factor;
  c->forward_comm_sms = config.forward_comm_sms;
  c->backward_comm_sms = config.backward_comm_sms;
  c->tile_rows = config.tile_rows;
  c->task_band_tiles = config.task_band_tiles;
  c->task_pairs = config.task_pairs ? 1 : 0;
}

// num_ranks, checked against the layer before any entry of the caller's array is read (an
// array shorter than a wrong count would be read past its end).
int32_t rank_count(const mok::Layer& layer, int32_t n) {
  mok::require(n >= 1, "num_ranks = " + std::to_string(n) + ": must be >= 1");
  try {
    mok::check_rank_count(layer.problem(), layer.options(), static_cast<std::size_t>(n));
  } catch (const mok::Error& e) {  // (named as the C caller gave it)
    throw mok::Error("num_ranks = " + std::to_string(n) + ": " + e.what());
  }
  return n;
}

// A rank's num_shared, by the C field's name (the layer's own check names its C++ arguments).
// 0 is the layer's to judge: a rank slice's other ranks pass no weights at all.
template <typename CRank>
void check_num_shared(const mok::Layer& layer, const CRank& a, const std::string& n) {
  const int want = layer.problem().num_shared();
  mok::require(a.num_shared == 0 || a.num_shared == want,
               n + ".num_shared = " + std::to_string(a.num_shared) + ": the layer's problem has " +
                   std::to_string(want) + " shared expert(s)");
}

}  // namespace

extern "C" {

int mok_c_abi_version(void) { return MOK_C_ABI_VERSION; }

const char* mok_last_error(void) { return last_error.c_str(); }

const char* mok_version(void) {
  static const std::string v = mok::version();
  return v.c_str();
}

const char* mok_build_commit(void) {
  static const std::string c = mok::build_commit();
  return c.c_str();
}

int mok_cuda_available(void) {
  int available = 0;
  guarded([&] { available = mok::cuda_available() ? 1 : 0; });
  return available;
}

void mok_default_config(mok_config* config) {
  if (config != nullptr) config_to(mok::Config{}, config);
}

int32_t mok_shape_count(void) {
  int32_t count = -1;
  guarded([&] { count = static_cast<int32_t>(mok::named_shapes().size()); });
  return count;
}

const char* mok_shape_name(int32_t index) {
  const char* name = nullptr;
  guarded([&] {
    const auto& shapes = mok::named_shapes();
    if (index >= 0 && index < static_cast<int32_t>(shapes.size())) name = shapes[index].name.c_str();
  });
  return name;
}

int mok_problem_from_shape(const char* name, int32_t ep_size, int32_t tokens_per_rank, mok_problem* problem) {
  return guarded([&] {
    require_not_null(name, "name");
    require_not_null(problem, "problem");
    mok::require(ep_size >= 0, "ep_size = " + std::to_string(ep_size) + ": must be >= 0 (0: the shape's default)");
    mok::require(tokens_per_rank >= 0,
                 "tokens_per_rank = " + std::to_string(tokens_per_rank) + ": must be >= 0 (0: the shape's default)");
    const mok::NamedShape& shape = mok::find_shape(name);
    const mok::Problem p = mok::problem_from_shape(shape, ep_size > 0 ? ep_size : shape.default_ep_size,
                                                   tokens_per_rank > 0 ? tokens_per_rank : shape.default_tokens);
    p.validate();  // (a problem handed out is one a layer takes)
    mok::require(p.num_shared() <= MOK_C_MAX_SHARED, std::string("shape ") + name + ": more shared experts than " +
                                                         std::to_string(MOK_C_MAX_SHARED));
    *problem = mok::capi::c_problem(p);
  });
}

int mok_layer_create(const mok_problem* problem, const mok_config* config, const mok_options* options,
                     mok_layer** layer) {
  return guarded([&] {
    require_not_null(layer, "layer");
    *layer = nullptr;  // (first: on any error the caller holds no stale handle)
    require_not_null(problem, "problem");
    require_not_null(options, "options");
    const mok::Problem p = problem_from(*problem);
    mok::LayerOptions o;
    o.backend = checked_enum<mok::Backend>(options->backend, MOK_BACKEND_CUDA + 1, "options.backend");
    o.ep_mode = checked_enum<mok::EpMode>(options->ep_mode, MOK_DISTRIBUTED + 1, "options.ep_mode");
    o.active_rank = options->active_rank;
    o.cpu_threads = options->cpu_threads;
    o.cuda_device = options->cuda_device;
    o.cuda_stream = options->cuda_stream;
    const mok::Config c = config != nullptr ? config_from(*config) : mok::Config{};
    *layer = new mok_layer{mok::Layer(p, c, o)};
  });
}

void mok_layer_destroy(mok_layer* layer) {
  // (mok::Layer's destructor does not throw; a collective destroy in a group waits for the
  // peers, as in C++.)
  delete layer;
}

void mok_layer_destroy_after_error(mok_layer* layer) {
  if (layer == nullptr) return;
  // (abandon_group reports nothing it could fail on: the abort's own status is not an error
  // a caller could act on, and a destroy must go on whatever happens.)
  try {
    layer->layer.abandon_group("the layer was destroyed after an error");
  } catch (...) {
  }
  delete layer;
}

int mok_layer_group_aborted(const mok_layer* layer, int32_t* aborted) {
  return guarded([&] {
    require_not_null(layer, "layer");
    require_not_null(aborted, "aborted");
    *aborted = layer->layer.group_aborted() ? 1 : 0;
  });
}

int mok_layer_abandon_group(mok_layer* layer, const char* why) {
  return guarded([&] {
    require_not_null(layer, "layer");
    layer->layer.abandon_group(why != nullptr ? why : "");
  });
}

int mok_layer_forward(mok_layer* layer, const mok_rank_forward* ranks, int32_t num_ranks) {
  return guarded([&] {
    require_not_null(layer, "layer");
    require_not_null(ranks, "ranks");
    std::vector<mok::RankForward> args;
    for (int r = 0, count = rank_count(layer->layer, num_ranks); r < count; ++r) {
      const mok_rank_forward& a = ranks[r];
      const std::string n = "ranks[" + std::to_string(r) + "]";
      check_num_shared(layer->layer, a, n);
      args.push_back({inputs_of(a, n), weights_of(a, n), view(a.y, n + ".y")});
    }
    layer->layer.forward(args);
  });
}

int mok_layer_backward(mok_layer* layer, const mok_rank_backward* ranks, int32_t num_ranks) {
  return guarded([&] {
    require_not_null(layer, "layer");
    require_not_null(ranks, "ranks");
    std::vector<mok::RankBackward> args;
    for (int r = 0, count = rank_count(layer->layer, num_ranks); r < count; ++r) {
      const mok_rank_backward& a = ranks[r];
      const std::string n = "ranks[" + std::to_string(r) + "]";
      check_num_shared(layer->layer, a, n);
      mok::RankBackward b;
      b.inputs = inputs_of(a, n);
      b.weights = weights_of(a, n);
      b.dy = view(a.dy, n + ".dy");
      b.dx = view(a.dx, n + ".dx");
      b.d_router_weights = view(a.d_router_weights, n + ".d_router_weights");
      b.d_w_gate = view(a.d_w_gate, n + ".d_w_gate");
      b.d_w_up = view(a.d_w_up, n + ".d_w_up");
      b.d_w_down = view(a.d_w_down, n + ".d_w_down");
      b.d_shared = shared_triples<mok::SharedExpertGrads>(a, a.d_shared, n, n + ".d_shared");
      args.push_back(std::move(b));
    }
    layer->layer.backward(args);
  });
}

int mok_layer_synchronize(mok_layer* layer) {
  return guarded([&] {
    require_not_null(layer, "layer");
    layer->layer.synchronize();
  });
}

int mok_layer_combine_slots(const mok_layer* layer, int32_t rank, mok_tensor* slots) {
  return guarded([&] {
    require_not_null(layer, "layer");
    require_not_null(slots, "slots");
    *slots = mok::capi::c_tensor(layer->layer.combine_slots(rank));
  });
}

int mok_layer_config(const mok_layer* layer, mok_config* config) {
  return guarded([&] {
    require_not_null(layer, "layer");
    require_not_null(config, "config");
    config_to(layer->layer.config(), config);
  });
}

}  // extern "C"
