# mok: the CUDA backend (sm_90a), compiled into mok_core. Included when nvcc exists.
# Only the static CUDA runtime is linked (no libcuda at link time): a build runs on
# machines without a GPU driver, where the cuda backend then reports "no device".
# Driver entry points (tensor maps) are fetched at run time with cudaGetDriverEntryPoint.
set(MOK_CUDA_SOURCES
  src/comm/ep_group.cpp
  src/cuda/backend.cu
  src/cuda/device_data.cu
  src/cuda/device_error.cpp
  src/cuda/device_timer.cu
)
target_sources(mok_core PRIVATE ${MOK_CUDA_SOURCES})
target_compile_options(mok_core PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -lineinfo
  -Xptxas=-v>)
set_target_properties(mok_core PROPERTIES CUDA_SEPARABLE_COMPILATION OFF POSITION_INDEPENDENT_CODE ON)
target_link_libraries(mok_core PUBLIC CUDA::cudart_static ${CMAKE_DL_LIBS})
target_compile_definitions(mok_core PUBLIC MOK_HAS_CUDA=1)
# The NCCL of the toolkit whose headers mok is built with: the distributed provider's second
# choice after the dynamic loader's libnccl.so.2 (comm/ep_group.h: nccl_library()). NCCL is
# never linked: it is opened at run time.
find_file(MOK_BUILD_NCCL_LIBRARY libnccl.so.2 PATHS ${CUDAToolkit_LIBRARY_DIR} NO_DEFAULT_PATH)
if(MOK_BUILD_NCCL_LIBRARY)
  set_property(SOURCE src/comm/ep_group.cpp APPEND PROPERTY COMPILE_DEFINITIONS
               MOK_BUILD_NCCL_LIBRARY="${MOK_BUILD_NCCL_LIBRARY}")
endif()

# Measurement builds (docs/PERFORMANCE.md): each defines MOK_MEASUREMENT_BUILD, a line saying
# what it changes, which every layer prints on stderr and which makes `mok bench` refuse to
# write records (time them with mok run or scripts/device_ab.sh).
# MOK_MEASURE_LEAVE_OUT=staging|stores|mma: the megakernel leaves one part of every compute tile
# out (the staging math, the store warp's row stores, or the wgmmas), to time what that part
# costs ("What each part of a compute tile costs"). Its outputs are wrong.
set(MOK_MEASURE_LEAVE_OUT "" CACHE STRING
    "measurement build: staging, stores or mma left out of the megakernel (wrong outputs)")
# MOK_MEASURE_PRODUCER_DELAY=<SM clocks>: the producer spins that long after each claim, before
# it reads the task's inputs, to measure what its chain between two tasks costs the forward
# ("Between two tiles"). Outputs are right; only the time is not the library's.
set(MOK_MEASURE_PRODUCER_DELAY "0" CACHE STRING
    "measurement build: SM clocks the producer waits after each claim (0: off)")
# Off only as "" or "0": any other value must be a count (CMake's if() would also read "OFF",
# "NO" or "FALSE" as off without a word, and "ON" as on with no count).
set(mok_producer_delay_on FALSE)
if(NOT "${MOK_MEASURE_PRODUCER_DELAY}" STREQUAL "" AND NOT "${MOK_MEASURE_PRODUCER_DELAY}" STREQUAL "0")
  set(mok_producer_delay_on TRUE)
endif()
# One measurement build: `what` (a line: what it changes) warned at configure time and defined
# as MOK_MEASUREMENT_BUILD, beside the build's own definitions (the other arguments).
function(mok_measurement_build what)
  message(WARNING "mok: MEASUREMENT BUILD: ${what}")
  target_compile_definitions(mok_core PUBLIC ${ARGN} "MOK_MEASUREMENT_BUILD=\"${what}\"")
endfunction()
if(MOK_MEASURE_LEAVE_OUT AND mok_producer_delay_on)
  message(FATAL_ERROR "MOK_MEASURE_LEAVE_OUT and MOK_MEASURE_PRODUCER_DELAY: one measurement per build")
endif()
if(MOK_MEASURE_LEAVE_OUT)
  if(NOT MOK_MEASURE_LEAVE_OUT MATCHES "^(staging|stores|mma)$")
    message(FATAL_ERROR "MOK_MEASURE_LEAVE_OUT must be staging, stores or mma (got '${MOK_MEASURE_LEAVE_OUT}')")
  endif()
  string(TOUPPER "${MOK_MEASURE_LEAVE_OUT}" leave_out)
  mok_measurement_build("MOK_MEASURE_LEAVE_OUT=${MOK_MEASURE_LEAVE_OUT}: the megakernel leaves out its ${MOK_MEASURE_LEAVE_OUT}, so the CUDA forward's outputs are wrong"
                        MOK_MEASURE_LEAVE_OUT_${leave_out}=1)
endif()
if(mok_producer_delay_on)
  if(NOT MOK_MEASURE_PRODUCER_DELAY MATCHES "^[1-9][0-9]?[0-9]?[0-9]?[0-9]?[0-9]?$")
    message(FATAL_ERROR "MOK_MEASURE_PRODUCER_DELAY must be a count of SM clocks from 1 to 999999, or 0 or empty for off (got '${MOK_MEASURE_PRODUCER_DELAY}')")
  endif()
  mok_measurement_build("MOK_MEASURE_PRODUCER_DELAY=${MOK_MEASURE_PRODUCER_DELAY}: the producer waits that many SM clocks after each claim, so the timings are not the library's"
                        MOK_MEASURE_PRODUCER_DELAY=${MOK_MEASURE_PRODUCER_DELAY})
endif()

# mok_pull_rate (bench/micro/pull_rate.cu): the dispatch mover's copy alone, by 1, 16 and
# every SM, for the question of what bounds a communication CTA's rate. A benchmark, not a
# test; it needs a GPU to run.
add_executable(mok_pull_rate bench/micro/pull_rate.cu)
target_include_directories(mok_pull_rate PRIVATE src include)
target_compile_options(mok_pull_rate PRIVATE -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas=-v)
target_link_libraries(mok_pull_rate PRIVATE CUDA::cudart_static ${CMAKE_DL_LIBS})

# mok_feed_rate (bench/micro/feed_rate.cu): the compute CTAs' mainloop alone (TMA stages of
# the megakernel's shape, with or without the wgmmas, alone or as 2-CTA multicast pairs), for
# the question of what bounds the operand feed. A benchmark, not a test; it needs a GPU.
add_executable(mok_feed_rate bench/micro/feed_rate.cu)
target_include_directories(mok_feed_rate PRIVATE src include)
target_compile_options(mok_feed_rate PRIVATE -gencode=arch=compute_90a,code=sm_90a -lineinfo -Xptxas=-v)
target_link_libraries(mok_feed_rate PRIVATE CUDA::cudart_static ${CMAKE_DL_LIBS})
