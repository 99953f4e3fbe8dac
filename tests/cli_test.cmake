# CLI checks run by CTest (see tests/CMakeLists.txt):
#   cmake -DMOK=<mok executable> -DMODE=<mode> -DWORK=<scratch dir> -P cli_test.cmake
# MODE save_load:     `mok run --shape tiny --save A` then `mok run --load A --save B`; both must
#                     exit 0, write the files, and the loaded run must reproduce A's outputs
#                     bitwise (y always, dx and d_w_gate when the backward ran); --load with
#                     --routing or --seed is refused.
# MODE unknown_shape: `mok run --shape nope` must exit with a non-zero status (not a crash)
#                     and say 'unknown name' on stderr, naming --shape; anything else fails.
# MODE bad_numbers:   out-of-range, partial or non-finite numbers on the command line fail,
#                     naming the option, the value and the range it must be in (they were
#                     truncated or partly read; --iters and --warmup near INT_MAX overflowed
#                     their sum and timed nothing; 1e-310 was "out of range" of no range said);
#                     the cpu backend's repetitions have a bound of their own.
# MODE bad_input:     malformed options, fields, directories and sizes are refused up front,
#                     naming what is wrong (each was accepted, silently changed, or crashed);
#                     a value the library's parser refuses (--routing, --dtype, --shape,
#                     --backend) is named with its option, and only such a value.
# MODE bad_active_rank: `mok run --shape tiny --ep-mode slice --active-rank X` for X out of
#                     [0, 2) or not a number must exit non-zero naming the option and its rule;
#                     --active-rank without a slice is refused.
foreach(var MOK MODE WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "cli_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run_mok out_rc out_stdout out_stderr)
  execute_process(COMMAND "${MOK}" ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE so ERROR_VARIABLE se TIMEOUT 120)
  set(${out_rc} "${rc}" PARENT_SCOPE)
  set(${out_stdout} "${so}" PARENT_SCOPE)
  set(${out_stderr} "${se}" PARENT_SCOPE)
endfunction()

# `mok ARGS...` must exit normally (no crash, no timeout) with a non-zero status and say
# `want` (a plain substring) on stderr.
function(expect_refused want)
  run_mok(rc so se ${ARGN})
  if(NOT rc MATCHES "^[0-9]+$" OR rc EQUAL 0)
    message(FATAL_ERROR "mok ${ARGN}: exit '${rc}', it must fail normally\n${so}\n${se}")
  endif()
  string(FIND "${se}" "${want}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "mok ${ARGN}: stderr lacks '${want}':\n${se}")
  endif()
endfunction()

if(MODE STREQUAL "save_load")
  file(REMOVE_RECURSE "${WORK}")
  set(A "${WORK}/saved")
  set(B "${WORK}/reloaded")
  run_mok(rc so se run --shape tiny --save "${A}")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "mok run --shape tiny --save: exit '${rc}'\n${so}\n${se}")
  endif()
  foreach(f problem.json rank0/x.npy rank1/top_experts.npy rank0/y.npy rank1/y.npy rank1/shared0_w_down.npy)
    if(NOT EXISTS "${A}/${f}")
      message(FATAL_ERROR "mok run --save did not write ${A}/${f}\n${so}")
    endif()
  endforeach()
  run_mok(rc so se run --load "${A}" --save "${B}")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "mok run --load: exit '${rc}'\n${so}\n${se}")
  endif()
  if(NOT so MATCHES "loaded:")
    message(FATAL_ERROR "mok run --load did not report the loaded problem:\n${so}")
  endif()
  # The saved routing is what runs: options that would make another are refused, not ignored.
  foreach(opt routing seed)
    if(opt STREQUAL "routing")
      set(val zipf:3)
    else()
      set(val 99)
    endif()
    expect_refused("option --${opt}: --load takes the problem, data and routing from DIR"
                   run --load "${A}" --${opt} ${val})
  endforeach()
  # --expect with a save of another problem (EP 2 against EP 1 here) is refused, not compared
  # in part (rank 0's y alone matched, and rank 1's went unread).
  expect_refused("option --expect ${A}: its problem.json is" run --shape tiny --ep 1 --expect "${A}")
  set(compared 0)
  foreach(rank rank0 rank1)
    foreach(name y dx d_w_gate shared0_d_w_up)
      if(NOT name STREQUAL "y" AND NOT EXISTS "${A}/${rank}/${name}.npy")
        continue()  # the backward did not run (e.g. a forward-only default backend)
      endif()
      if(NOT EXISTS "${B}/${rank}/${name}.npy")
        message(FATAL_ERROR "the --load run did not write ${B}/${rank}/${name}.npy")
      endif()
      file(SHA256 "${A}/${rank}/${name}.npy" ha)
      file(SHA256 "${B}/${rank}/${name}.npy" hb)
      if(NOT ha STREQUAL hb)
        message(FATAL_ERROR "${rank}/${name}.npy differs between the saved and the reloaded run")
      endif()
      math(EXPR compared "${compared} + 1")
    endforeach()
  endforeach()
  if(compared LESS 2)
    message(FATAL_ERROR "nothing was compared")
  endif()
  file(REMOVE_RECURSE "${WORK}")
  message(STATUS "save/load: ${compared} output files identical")
elseif(MODE STREQUAL "unknown_shape")
  expect_refused("option --shape 'nope': shape: unknown name 'nope'" run --shape nope)
elseif(MODE STREQUAL "bad_numbers")
  # Numbers are taken whole and in range, never truncated or partly read.
  set(cases
      "--ep|4294967298|option --ep: 4294967298 is out of range"
      "--tokens|4294967312|option --tokens: 4294967312 is out of range"
      "--iters|4294967297|option --iters: must be in [1, 10000] on the cpu backend, got 4294967297"
      "--shared|128abc|'128abc' is not an integer"
      "--swiglu-limit|nan|option --swiglu-limit: must be a finite number"
      "--capacity|inf|option --capacity: must be a finite number"
      "--seed|-1|option --seed: -1 is out of range"
      "--seed|18446744073709551615|option --seed: 18446744073709551615 is out of range"
      "--tokens|99999999999999999999|option --tokens: 99999999999999999999 is out of range [1, 2147483647]"
      "--tokens|99999999999999999999x|option --tokens: '99999999999999999999x' is not an integer"
      # Beyond int's range: the option's own bound, not int's (which read as if negatives passed).
      "--tokens|-99999999999|option --tokens: -99999999999 is out of range [1, 2147483647]"
      "--threads|-99999999999|option --threads: -99999999999 is out of range [0, 2147483647]"
      "--iters|99999999999|option --iters: must be in [1, 10000] on the cpu backend, got 99999999999"
      "--shared|-128|option --shared (a comma list or 'none'): -128 is out of range [1, 2147483647]"
      # A number double cannot hold says so and what the option takes (1e-310 underflowed to
      # "'1e-310' is out of range", of no range said; a denormal would keep fewer digits).
      "--capacity|4.9406564584124654e-324|option --capacity: '4.9406564584124654e-324' is too small to read"
      "--capacity|-1e-400|option --capacity: '-1e-400' is too small to read"
      "--swiglu-limit|1e-40|option --swiglu-limit: 1e-40 is out of range [1.1754943508222875e-38, 3.4028234663852886e+38] (a positive normal float"
      "--swiglu-limit|1e-310|option --swiglu-limit: '1e-310' is too small to read")
  foreach(c IN LISTS cases)
    string(REPLACE "|" ";" parts "${c}")
    list(GET parts 0 opt)
    list(GET parts 1 val)
    list(GET parts 2 want)
    expect_refused("${want}" run --shape tiny ${opt} ${val})
  endforeach()
  # (Messages with a ';' or a half-open range's lone ']', at which a CMake list would split or not.)
  expect_refused("option --routing 'hot:1e-310': routing: hot fraction '1e-310' is too small to read (a nonzero magnitude below double's smallest normal, 2.2250738585072014e-308); must be in [0, 1]"
                 run --shape tiny --routing hot:1e-310)
  expect_refused("option --capacity: '1e-310' is too small to read (a nonzero magnitude below double's smallest normal, 2.2250738585072014e-308); must be in (0, 1]"
                 run --shape tiny --capacity 1e-310)
  expect_refused("option --capacity: '1e400' is out of range (beyond double's largest magnitude, 1.7976931348623157e+308); must be in (0, 1]"
                 run --shape tiny --capacity 1e400)
  expect_refused("option --capacity: 2 is out of range (0, 1]" run --shape tiny --capacity 2)
  expect_refused("option --capacity: must be a finite number in (0, 1], got '-inf'" run --shape tiny --capacity -inf)
  expect_refused("option --grace: must be a finite number in [0, 1e+07] seconds" launch -n 2 --grace nan -- true)
  expect_refused("option --timeout: '1e-310' is too small to read" launch -n 2 --timeout 1e-310 -- true)
  # The repetitions: a million on the cuda backend; on the cpu backend, whose passes take up to
  # seconds, ten thousand (a million was taken there, days of running).
  expect_refused("option --iters: must be in [1, 1000000] on the cuda backend, got 2147483647"
                 run --shape tiny --backend cuda --iters 2147483647)
  expect_refused("option --warmup: must be in [0, 1000000] on the cuda backend, got 2000000"
                 run --shape tiny --backend cuda --warmup 2000000)
  expect_refused("option --iters: must be in [1, 10000] on the cpu backend, got 10001 (a pass of the CPU reference takes up to seconds"
                 run --shape tiny --backend cpu --iters 10001)
  expect_refused("option --warmup: must be in [0, 10000] on the cpu backend, got 10001"
                 run --shape tiny --backend cpu --warmup 10001)
  expect_refused("option --iters: must be in [1, 10000] on the cpu backend, got 1000000"
                 run --shape tiny --backend cpu --iters 1000000)
  # Decimal only (stod also reads hex), and a value past double's range is said to be.
  expect_refused("option --capacity: '0x1p-1' is not a number" run --shape tiny --capacity 0x1p-1)
  expect_refused("routing: hot expert: '0x3' is not an integer" run --shape tiny --routing hot:0.5:0x3)
  expect_refused("option --routing 'zipf:1e400': routing: zipf exponent '1e400' is out of range (beyond double's largest magnitude, 1.7976931348623157e+308); must be finite and >= 0"
                 run --shape tiny --routing zipf:1e400)
  expect_refused("option -n: 'abc' is not an integer" launch -n abc -- true)
  expect_refused("mok launch: -n must be in [1, 4096], got 99999999999" launch -n 99999999999 -- true)
  # A blank on either side is not part of a number (stoll and stod skipped leading ones only).
  expect_refused("option --tokens: ' 64' is not an integer" run --shape tiny --tokens " 64")
  expect_refused("option --tokens: '64 ' is not an integer" run --shape tiny --tokens "64 ")
  expect_refused("option --capacity: ' 0.5' is not a number" run --shape tiny --capacity " 0.5")
  expect_refused("routing: zipf exponent ' 1.2' is not a number" run --shape tiny "--routing=zipf: 1.2")
elseif(MODE STREQUAL "bad_input")
  file(REMOVE_RECURSE "${WORK}")
  set(small --experts 8 --hidden 256 --intermediate 256 --topk 2 --ep 2 --tokens 64 --shared none)
  # An option missing its value does not swallow the next option; flags count once.
  expect_refused("option --save: needs a value, got the option '--check'" run ${small} --save --check)
  # An error of the layer's call names the option behind the field it names.
  expect_refused("raise schedule_capacity_factor (1.0 covers every routing). No token was dropped: nothing ran. [options: --capacity]"
                 run --shape small --backend cpu --routing worst:0 --capacity 0.01)
  expect_refused("option --check: given twice" run ${small} --check --check)
  # A misspelt option is unknown, wherever it stands (not "needs a value"); the launcher's
  # -n is named as spelled.
  expect_refused("unknown or unused option(s): --chek" run ${small} --chek)
  expect_refused("unknown or unused option(s): --chek" run --chek ${small})
  expect_refused("unknown or unused option(s): --grce" launch -n 2 --grce -- true)
  # A value the library's parser refuses is named with the option it was given to (the
  # messages named the field alone: "routing: ...", "dtype: ...").
  expect_refused("option --backend 'tpu': backend: must be cpu or cuda, got 'tpu'" run ${small} --backend tpu)
  expect_refused("option --routing 'hot:x:0': routing: hot fraction 'x' is not a number"
                 run --shape tiny --routing hot:x:0)
  expect_refused("option --routing 'nope': routing: unknown kind 'nope'" run --shape tiny --routing nope)
  expect_refused("option --dtype 'fp4': dtype: must be bf16 or mxfp8, got 'fp4'" run --shape tiny --dtype fp4)
  # ... also where the spec is judged with the problem (the routing is drawn after the parse).
  expect_refused("option --routing 'hot:0.5:99': routing: hot expert 99 must be in [0, 8)"
                 run --shape tiny --routing hot:0.5:99)
  expect_refused("option --routing 'file:${WORK}': routing file:${WORK}: no top_experts.npy"
                 run --shape tiny --routing "file:${WORK}")
  # ... and only such a value: an error the routing leads to later (the schedule's capacity)
  # is not --routing's.
  run_mok(rc so se run --shape small --backend cpu --routing worst:0 --capacity 0.01)
  if(NOT se MATCHES "raise schedule_capacity_factor" OR se MATCHES "option --routing")
    message(FATAL_ERROR "an error after the routing's parse was labelled as --routing's value:\n${se}")
  endif()
  # The library's errors about the EP mode name the options that set them.
  expect_refused("[options: --ep-mode, --backend]" run ${small} --backend cpu --ep-mode slice)
  # Refused before any work or file: a slice's save could never be loaded, the cuda backend
  # has no backward, and a count of communication SMs beyond any GPU's is refused as such.
  # (On the cuda backend, with or without a GPU here: the cpu backend refuses a slice first.)
  expect_refused("option --save with --ep-mode slice: a slice makes only its active rank's weights"
                 run ${small} --backend cuda --ep-mode slice --save "${WORK}/slice_save")
  if(EXISTS "${WORK}/slice_save")
    message(FATAL_ERROR "--save with a slice: refused, but its directory was created")
  endif()
  expect_refused("option --pass both: the cuda backend runs the forward only" run ${small} --backend cuda --pass both)
  expect_refused("option --pass backward: the cuda backend runs the forward only"
                 run ${small} --backend cuda --pass backward)
  expect_refused("Config.forward_comm_sms = 2147483647: must be in [0, 1024] (0 = auto) [options: --comm-sms]"
                 run ${small} --comm-sms 2147483647 --pairs)
  expect_refused("option -n: needs a value" launch -n -- true)
  expect_refused("option -n: given twice" launch -n 2 -n 3 -- true)
  expect_refused("mok launch: option --n: the number of ranks is spelled -n (one dash)" launch --n 2 -- true)
  expect_refused("mok launch: option --n: the number of ranks is spelled -n (one dash)" launch --n=2 -- true)
  # Empty fields are errors, not defaults; so is an empty value, and a value given to a flag.
  foreach(bad "256," ",256")
    expect_refused("option --shared (a comma list or 'none')" run --shape tiny "--shared=${bad}")
  endforeach()
  expect_refused("option --shared: the value is empty" run --shape tiny "--shared=")
  expect_refused("option --expect: the value is empty" run --shape tiny "--expect=")
  # The same empty value as the next argument (a list drops empty elements: called directly).
  foreach(option expect load)
    execute_process(COMMAND "${MOK}" run --shape tiny --${option} ""
                    RESULT_VARIABLE rc OUTPUT_VARIABLE so ERROR_VARIABLE se TIMEOUT 120)
    string(FIND "${se}" "option --${option}: the value is empty" at)
    if(NOT rc MATCHES "^[0-9]+$" OR rc EQUAL 0 OR at EQUAL -1)
      message(FATAL_ERROR "mok run --shape tiny --${option} '': exit '${rc}', it must be refused naming the empty value\n${se}")
    endif()
  endforeach()
  expect_refused("option --check: is a flag and takes no value (got '--check=yes')" run --shape tiny --check=yes)
  expect_refused("zipf exponent '' is not a number" run --shape tiny --routing zipf:)
  expect_refused("too many ':' fields" run --shape tiny --routing gaussian:)
  # mok bench names the options of a bad config before any work (and before asking for a GPU;
  # a build without the CUDA backend has no mok bench to ask).
  run_mok(rc so se bench --shape tiny --minibatch 7 --work-dir "${WORK}/bench_bad")
  if(se MATCHES "this build has no CUDA backend")
    message(STATUS "mok bench option checks skipped: this build has no CUDA backend")
  else()
    # ... and only options it has: the message names tile_rows, which mok bench cannot set.
    expect_refused("Config.minibatch_rows = 7: must be a positive multiple of tile_rows (128) [options: --minibatch]"
                   bench --shape tiny --minibatch 7 --work-dir "${WORK}/bench_bad")
    expect_refused("option --exchange-timeout: applies only with --ep-mode distributed"
                   bench --shape tiny --exchange-timeout 5 --work-dir "${WORK}/bench_bad")
    expect_refused("option --no-peer-inputs: is a flag and takes no value (got '--no-peer-inputs=yes')"
                   bench --shape tiny --no-peer-inputs=yes --work-dir "${WORK}/bench_bad")
    expect_refused("option --dtype mxfp8: mok bench times the cuda backend, which runs bf16 only so far"
                   bench --shape tiny --dtype mxfp8 --work-dir "${WORK}/bench_bad")
    expect_refused("option --routing 'zipf:x': routing: zipf exponent 'x' is not a number"
                   bench --shape tiny --routing zipf:x --work-dir "${WORK}/bench_bad")
    expect_refused("option --exchange-timeout: 0 is out of range (0, 1e+07] seconds"
                   bench --shape tiny --exchange-timeout 0 --work-dir "${WORK}/bench_bad")
    expect_refused("option --iters: must be in [1, 1000000] on the cuda backend, got 2000000"
                   bench --shape tiny --iters 2000000 --work-dir "${WORK}/bench_bad")
  endif()
  # y is not computed without the forward: nothing to compare, nothing saved.
  expect_refused("option --expect: compares y, which --pass backward does not compute"
                 run ${small} --pass backward --expect "${WORK}")
  run_mok(rc so se run ${small} --backend cpu --pass backward --save "${WORK}/bwd")
  if(NOT rc STREQUAL "0" OR EXISTS "${WORK}/bwd/rank0/y.npy" OR NOT EXISTS "${WORK}/bwd/rank0/dx.npy")
    message(FATAL_ERROR "--pass backward --save: exit '${rc}', it must save dx and no y\n${se}")
  endif()
  # --expect's files are looked for before any work, and before --save claims its directory.
  expect_refused("option --expect ${WORK}/none: no such directory"
                 run ${small} --backend cpu --expect "${WORK}/none" --save "${WORK}/unclaimed")
  if(EXISTS "${WORK}/unclaimed")
    message(FATAL_ERROR "--expect with a missing file: --save's directory was created before the refusal")
  endif()
  # Every computed rank's expected y is held in memory: a set larger than the machine is refused
  # before it is read.
  expect_refused("option --expect ${WORK}/none (every computed rank's y) needs"
                 run --backend cpu --experts 64 --hidden 65536 --intermediate 256 --topk 2 --ep 64
                 --tokens 1048576 --shared none --expect "${WORK}/none")
  # A save never mixes two runs' files.
  expect_refused("already holds files" run ${small} --save "${WORK}/bwd")
  # ... nor writes into the save it loads from (a rank<r>/ there made it another problem's).
  expect_refused("option --save ${WORK}/bwd/rank2: is inside --load's directory ${WORK}/bwd"
                 run --backend cpu --load "${WORK}/bwd" --pass forward --save "${WORK}/bwd/rank2")
  if(EXISTS "${WORK}/bwd/rank2")
    message(FATAL_ERROR "--save inside --load: the directory was made before the refusal")
  endif()
  # A directory option given a file, or nothing, says which.
  expect_refused("--load ${WORK}/bwd/problem.json: not a directory"
                 run --backend cpu --load "${WORK}/bwd/problem.json")
  expect_refused("--load ${WORK}/none: no such directory" run --backend cpu --load "${WORK}/none")
  expect_refused("option --expect ${WORK}/bwd/problem.json: not a directory"
                 run ${small} --backend cpu --expect "${WORK}/bwd/problem.json")
  # A file --load reads that is cut short is named with the option, as its other errors are.
  file(COPY "${WORK}/bwd/" DESTINATION "${WORK}/cut")
  execute_process(COMMAND head -c 200 "${WORK}/bwd/rank0/w_up.npy" OUTPUT_FILE "${WORK}/cut/rank0/w_up.npy")
  expect_refused("--load ${WORK}/cut: npy file '${WORK}/cut/rank0/w_up.npy': holds"
                 run --backend cpu --load "${WORK}/cut" --pass forward)
  # A problem.json that does not describe its files is reported before allocating its sizes.
  file(READ "${WORK}/bwd/problem.json" pj)
  string(REGEX REPLACE "\"tokens_per_rank\": [0-9]+" "\"tokens_per_rank\": 20000000" pj "${pj}")
  file(WRITE "${WORK}/bwd/problem.json" "${pj}")
  string(TIMESTAMP t0 "%s")
  expect_refused("does not match the expected (20000000, 256)" run --load "${WORK}/bwd" --pass forward)
  string(TIMESTAMP t1 "%s")
  math(EXPR elapsed "${t1} - ${t0}")
  if(elapsed GREATER 10)
    message(FATAL_ERROR "the mismatched problem.json took ${elapsed} s to report")
  endif()
  # More host memory than any machine has: refused before the routing is drawn.
  expect_refused("GiB of host memory, more than the" run --experts 8 --hidden 256 --intermediate 256 --topk 2
                 --ep 2 --tokens 500000000 --shared none)
  # Help for each command, and -n required by launch.
  foreach(cmd shapes launch bench)
    run_mok(rc so se ${cmd} --help)
    if(NOT so MATCHES "usage: mok" AND NOT se MATCHES "no CUDA backend")
      message(FATAL_ERROR "mok ${cmd} --help: exit '${rc}'\n${so}\n${se}")
    endif()
  endforeach()
  run_mok(rc so se --help)
  if(NOT rc STREQUAL "0" OR NOT so MATCHES "commands:")
    message(FATAL_ERROR "mok --help must list the commands:\n${so}")
  endif()
  expect_refused("-n N (the number of ranks) is required" launch -- true)
  expect_refused("mok help: takes no arguments, got 'extra'" help extra)
  # The cpu backend's refusal of a group comes first, not the environment's "start it with
  # mok launch" (after which the same run is refused for the backend).
  expect_refused("LayerOptions.ep_mode = distributed: the cpu backend holds every rank"
                 run ${small} --backend cpu --ep-mode distributed)
  # --threads sizes the CPU reference, which the cuda backend runs only with --check.
  expect_refused("option --threads: sizes the CPU reference's thread pool, which --backend cuda runs only with --check"
                 run ${small} --backend cuda --threads 2)
  # A clamp the layer's float cannot hold is refused as written.
  expect_refused("option --swiglu-limit: 1e-50 is out of range [1.1754943508222875e-38, 3.4028234663852886e+38]"
                 run --shape tiny --swiglu-limit 1e-50)
  expect_refused("option --swiglu-limit: 1e39 is out of range [1.1754943508222875e-38, 3.4028234663852886e+38]"
                 run --shape tiny --swiglu-limit 1e39)
  # The library's rules name their fields; the tool adds the options that set them.
  expect_refused("must be divisible by ep_size (3) [options: --experts or --shape, --ep]"
                 run --experts 8 --hidden 256 --intermediate 256 --topk 2 --ep 3 --tokens 64 --shared none)
  expect_refused("Config.tile_rows = 100" run ${small} --backend cpu --tile-rows 100 --save "${WORK}/cfg")
  expect_refused("[options: --tile-rows]" run ${small} --backend cpu --tile-rows 100)
  expect_refused("[options: --threads]" run ${small} --backend cpu --threads -1)
  if(EXISTS "${WORK}/cfg")
    message(FATAL_ERROR "a bad --tile-rows was refused after --save claimed its directory")
  endif()
  # Tuning only the cuda backend reads is refused on the cpu backend (it was printed as used),
  # before --save claims anything; so are LayerOptions the cpu backend would ignore.
  foreach(tuning "--band;3" "--comm-sms;5" "--pairs" "--macrobatch;8192" "--minibatch;256")
    list(GET tuning 0 option)
    expect_refused("option ${option}: tunes the cuda backend; the cpu backend does not read it"
                   run ${small} --backend cpu ${tuning} --save "${WORK}/cuda_only")
  endforeach()
  expect_refused("LayerOptions.ep_mode = rank_slice: the cpu backend holds every rank"
                 run ${small} --backend cpu --ep-mode slice --save "${WORK}/cuda_only")
  if(EXISTS "${WORK}/cuda_only")
    message(FATAL_ERROR "an option the cpu backend does not take was refused after --save claimed its directory")
  endif()
  # A run that fails after claiming --save (here the schedule's capacity, found by the layer)
  # removes the directories it created for it, and only those.
  file(MAKE_DIRECTORY "${WORK}/kept_parent")
  expect_refused("raise schedule_capacity_factor"
                 run --shape small --backend cpu --routing worst:0 --capacity 0.01 --save "${WORK}/kept_parent/a/b")
  if(EXISTS "${WORK}/kept_parent/a" OR NOT IS_DIRECTORY "${WORK}/kept_parent")
    message(FATAL_ERROR "a failed run left the --save directories it created, or removed one it did not create")
  endif()
  # --save names a file: not a directory, said as such.
  file(WRITE "${WORK}/afile" "x")
  expect_refused("option --save ${WORK}/afile: is not a directory" run ${small} --backend cpu --save "${WORK}/afile")
  # --expect's files are read whole before any work: a truncated one is refused up front.
  run_mok(rc so se run ${small} --backend cpu --pass forward --save "${WORK}/fwd")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "--pass forward --save: exit '${rc}'\n${se}")
  endif()
  file(COPY "${WORK}/fwd/rank0" "${WORK}/fwd/rank1" DESTINATION "${WORK}/exp")
  file(REMOVE "${WORK}/exp/rank1/y.npy")
  execute_process(COMMAND head -c 200 "${WORK}/fwd/rank1/y.npy" OUTPUT_FILE "${WORK}/exp/rank1/y.npy")
  expect_refused("option --expect ${WORK}/exp: " run ${small} --backend cpu --expect "${WORK}/exp"
                 --save "${WORK}/unclaimed2")
  if(EXISTS "${WORK}/unclaimed2")
    message(FATAL_ERROR "--expect with a truncated file: --save's directory was claimed before the refusal")
  endif()
  # A save that fails part way (here the file-size limit) leaves no partial tensors behind.
  execute_process(COMMAND bash -c "trap '' XFSZ; ulimit -f 16; exec \"$0\" \"$@\"" "${MOK}" run ${small}
                          --backend cpu --pass forward --save "${WORK}/partial"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE so ERROR_VARIABLE se TIMEOUT 120)
  file(GLOB_RECURSE left "${WORK}/partial/*")
  if(rc STREQUAL "0" OR NOT se MATCHES "is removed" OR left)
    message(FATAL_ERROR "a save that failed part way: exit '${rc}', left '${left}'\n${se}")
  endif()
  # A dangling symbolic link on --save's path is named as such, and left as it was (it was
  # taken for a directory this run made, and removed on the way out).
  file(CREATE_LINK "${WORK}/no/such/target" "${WORK}/dangling" SYMBOLIC)
  foreach(target "${WORK}/dangling" "${WORK}/dangling/out")
    expect_refused("${WORK}/dangling is a symbolic link to a missing target" run ${small} --backend cpu
                   --pass forward --save "${target}")
    if(NOT IS_SYMLINK "${WORK}/dangling")
      message(FATAL_ERROR "--save ${target}: the run removed a symbolic link it did not make")
    endif()
  endforeach()
  # A directory another run has claimed for its save (its claim file there) is refused, and
  # the claim left alone: two runs started on one empty directory cannot both save into it.
  file(WRITE "${WORK}/claimed/.mok_save_claim" "")
  expect_refused("another mok run is saving there" run ${small} --backend cpu --pass forward --save "${WORK}/claimed")
  if(NOT EXISTS "${WORK}/claimed/.mok_save_claim")
    message(FATAL_ERROR "a refused --save removed another run's claim")
  endif()
  # A claim whose process is gone (same host, no such pid: a run killed outright, as `mok
  # launch` stops a failed group's other ranks) is taken over, not a directory refused for good.
  execute_process(COMMAND sh -c "echo $$" OUTPUT_VARIABLE gone_pid OUTPUT_STRIP_TRAILING_WHITESPACE)
  execute_process(COMMAND hostname OUTPUT_VARIABLE host OUTPUT_STRIP_TRAILING_WHITESPACE)
  file(WRITE "${WORK}/stale/.mok_save_claim" "${gone_pid} ${host}\n")
  run_mok(rc so se run ${small} --backend cpu --pass forward --save "${WORK}/stale")
  if(NOT rc STREQUAL "0" OR EXISTS "${WORK}/stale/.mok_save_claim" OR NOT EXISTS "${WORK}/stale/problem.json")
    message(FATAL_ERROR "a stale claim (pid ${gone_pid} on ${host}) was not taken over: exit '${rc}'\n${se}")
  endif()
  # A successful save leaves no claim behind.
  if(EXISTS "${WORK}/fwd/.mok_save_claim")
    message(FATAL_ERROR "a finished --save left its claim file")
  endif()
  # --load: a problem.json far larger than any save writes is refused before it is read, and a
  # distributed run's save (each rank's y alone) is named as such.
  file(COPY "${WORK}/fwd/problem.json" DESTINATION "${WORK}/huge")
  execute_process(COMMAND truncate -s 2M "${WORK}/huge/problem.json")
  expect_refused("problem.json holds 2097152 bytes" run --load "${WORK}/huge" --backend cpu)
  file(COPY "${WORK}/fwd/rank0/y.npy" DESTINATION "${WORK}/ysave/rank0")
  expect_refused("a distributed run's --save" run --load "${WORK}/ysave" --backend cpu)
  file(REMOVE_RECURSE "${WORK}")
elseif(MODE STREQUAL "bad_active_rank")
  # Out of range and not a number: each must fail normally, naming the option and its rule.
  # (On the cuda backend, with or without a GPU here: the cpu backend refuses a slice first.)
  foreach(bad 2 -1 1x)
    expect_refused("option --active-rank: must be busiest or a rank in [0, 2), got '${bad}'"
                   run --shape tiny --backend cuda --ep-mode slice --active-rank ${bad})
  endforeach()
  # Not a slice: the option would be ignored, so it is refused.
  expect_refused("option --active-rank: only a rank slice" run --shape tiny --active-rank 0)
elseif(NOT MODE MATCHES "^launch_")
  message(FATAL_ERROR "cli_test.cmake: unknown MODE '${MODE}'")
endif()

# MODE launch_ok:     `mok launch -n 3 -- sh -c ...` runs three ranks with MOK_RANK 0..2 and
#                     multicast off, and exits 0.
# MODE launch_killed: rank 1 of 3 kills itself; the launcher must stop the others (which
#                     would sleep for 300 s) well within 60 s, exit non-zero and name rank 1;
#                     and the other ways a launch ends badly (a stopped rank, --timeout,
#                     leftovers, a killed launcher, two ranks failing in one look).
if(MODE STREQUAL "launch_ok")
  run_mok(rc so se launch -n 3 -- sh -c "echo rank=$MOK_RANK world=$MOK_WORLD_SIZE nvls=$NCCL_NVLS_ENABLE nvshmem_nvls=$NVSHMEM_DISABLE_NVLS multicast=$TORCH_SYMM_MEM_DISABLE_MULTICAST")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "mok launch: exit '${rc}'\n${so}\n${se}")
  endif()
  foreach(r 0 1 2)
    if(NOT so MATCHES "rank=${r} world=3 nvls=0 nvshmem_nvls=1 multicast=1")
      message(FATAL_ERROR "mok launch: rank ${r} did not run with the expected environment:\n${so}")
    endif()
  endforeach()
elseif(MODE STREQUAL "launch_killed")
  # (a script file: CMake would split an inline command at its semicolons)
  file(MAKE_DIRECTORY "${WORK}")
  file(WRITE "${WORK}/rank.sh" "if [ \"$MOK_RANK\" = 1 ]\nthen\n  sleep 1\n  kill -9 $$\nfi\nsleep 300\n")
  string(TIMESTAMP t0 "%s")
  run_mok(rc so se launch -n 3 -- sh "${WORK}/rank.sh")
  string(TIMESTAMP t1 "%s")
  math(EXPR elapsed "${t1} - ${t0}")
  if(rc STREQUAL "0" OR NOT rc MATCHES "^[0-9]+$")
    message(FATAL_ERROR "mok launch with a killed rank: expected a non-zero exit, got '${rc}'\n${se}")
  endif()
  if(NOT se MATCHES "rank 1 was killed by signal 9")
    message(FATAL_ERROR "mok launch did not name the killed rank:\n${se}")
  endif()
  if(elapsed GREATER 60)
    message(FATAL_ERROR "mok launch took ${elapsed} s to stop the other ranks (limit 60 s)")
  endif()
  if(NOT rc STREQUAL "137")
    message(FATAL_ERROR "mok launch with a rank killed by signal 9: exit '${rc}', 128 + 9 expected\n${se}")
  endif()
  # A rank stopped by a signal never ends: the launcher says so and stops the launch at once
  # (it waited for it without end).
  file(WRITE "${WORK}/stop.sh" "if [ \"$MOK_RANK\" = 1 ]\nthen\n  kill -STOP $$\nfi\nsleep 300\n")
  string(TIMESTAMP t0 "%s")
  run_mok(rc so se launch -n 2 --grace 2 -- sh "${WORK}/stop.sh")
  string(TIMESTAMP t1 "%s")
  math(EXPR elapsed "${t1} - ${t0}")
  if(NOT rc STREQUAL "147" OR NOT se MATCHES "rank 1 was stopped by signal 19" OR elapsed GREATER 60)
    message(FATAL_ERROR "mok launch with a stopped rank: exit '${rc}' after ${elapsed} s (147 expected)\n${se}")
  endif()
  # --timeout: its own status (124, as timeout(1)), apart from any rank's, naming the ranks
  # still running.
  file(WRITE "${WORK}/slow.sh" "if [ \"$MOK_RANK\" = 1 ]\nthen\n  sleep 300\nfi\n")
  run_mok(rc so se launch -n 2 --timeout 1 --grace 2 -- sh "${WORK}/slow.sh")
  if(NOT rc STREQUAL "124" OR NOT se MATCHES "timed out after 1 s with rank 1 still running")
    message(FATAL_ERROR "mok launch --timeout: exit '${rc}' (124 expected)\n${se}")
  endif()
  # A rank paused and resumed within the grace (a job scheduler's suspend, say) goes on.
  file(WRITE "${WORK}/pause.sh" "(sleep 1\nkill -CONT $$) &\nkill -STOP $$\nexit 0\n")
  run_mok(rc so se launch -n 2 --grace 10 -- sh "${WORK}/pause.sh")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "mok launch with ranks paused and resumed: exit '${rc}', 0 expected\n${se}")
  endif()
  # Processes a rank started and left running (a wrapper's children) are stopped when the
  # launch ends, whether the rank failed or exited 0: none may hold a GPU afterwards.
  string(RANDOM LENGTH 12 ALPHABET 0123456789 tag)
  # Also one that left its rank's process group (setsid: a wrapper's `timeout`, Python's
  # start_new_session), which no signal to the group reaches.
  file(WRITE "${WORK}/leave.sh" "sleep 3${tag} &\necho $! > \"${WORK}/left_$MOK_RANK\"\n"
             "setsid sh -c 'echo $$ > \"${WORK}/escaped_$MOK_RANK\"; exec sleep 4${tag}' &\n"
             "n=0\nwhile [ ! -s \"${WORK}/escaped_$MOK_RANK\" ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n + 1)); done\n"
             "exit 0\n")
  run_mok(rc so se launch -n 2 --grace 2 -- sh "${WORK}/leave.sh")
  if(NOT rc STREQUAL "0" OR NOT se MATCHES "still running after it ended; stopping them" OR
     NOT se MATCHES "2 process\\(es\\) the ranks started in a process group of their own were still running after the ranks ended; stopped them")
    message(FATAL_ERROR "mok launch whose ranks left processes: exit '${rc}'\n${se}")
  endif()
  foreach(left left_0 left_1 escaped_0 escaped_1)
    file(READ "${WORK}/${left}" left_pid)
    string(STRIP "${left_pid}" left_pid)
    # (Alive: a /proc entry that is not a zombie; an init that reaps nothing keeps zombies.)
    set(alive FALSE)
    if(EXISTS "/proc/${left_pid}/stat")
      file(READ "/proc/${left_pid}/stat" stat)
      if(NOT stat MATCHES "^[0-9]+ \\(.*\\) [ZX] ")
        set(alive TRUE)
      endif()
    endif()
    if(alive)
      execute_process(COMMAND kill -9 ${left_pid})
      message(FATAL_ERROR "mok launch left a rank's child (${left}) ${left_pid} running")
    endif()
  endforeach()
  # The launcher killed outright (SIGKILL: no handler runs): its guardian stops what the ranks
  # started (a rank's own PDEATHSIG reaches only its first process). The script fails naming
  # any child of a rank still running 4 s later, and stops it.
  execute_process(COMMAND sh "${CMAKE_CURRENT_LIST_DIR}/launch_orphans.sh" "${MOK}" "${WORK}/orphans.log" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE so ERROR_VARIABLE se)
  file(READ "${WORK}/orphans.log" launch_log)
  # (Both: the processes left, and the guardian's word for what it stopped.)
  set(guardian_said "the launcher ended without stopping its ranks; stopping 2 rank process group\\(s\\) and 2 ")
  string(APPEND guardian_said "process\\(es\\) that left them")
  if(NOT rc STREQUAL "0" OR NOT launch_log MATCHES "${guardian_said}")
    message(FATAL_ERROR "mok launch killed with SIGKILL: exit '${rc}' of the check (1: a rank's child left "
                        "running)\n${so}\n${se}\n${launch_log}")
  endif()
  # A launch inside a rank of another, its launcher killed outright: the outer launch ending
  # meanwhile leaves the inner guardian to finish stopping the inner rank (the script fails
  # naming the inner rank's child if it is still running afterwards).
  execute_process(COMMAND sh "${CMAKE_CURRENT_LIST_DIR}/launch_nested.sh" "${MOK}" "${WORK}/nested.log" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE so ERROR_VARIABLE se)
  file(READ "${WORK}/nested.log" launch_log)
  # (The inner guardian's word that it stopped the inner rank: the check ran what it says.)
  if(NOT rc STREQUAL "0" OR launch_log MATCHES "process group of their own" OR
     NOT launch_log MATCHES "the launcher ended without stopping its ranks; stopping 1 rank process group")
    message(FATAL_ERROR "mok launch inside a rank, its launcher killed: exit '${rc}' of the check (1: the inner "
                        "rank's child left running)\n${so}\n${se}\n${launch_log}")
  endif()
  # Two ranks failing for their own reasons, seen ended in the same look at the ranks (the
  # launcher held stopped while both exit): both are named, the first in index order giving
  # the status, since which came first is not known.
  execute_process(COMMAND sh "${CMAKE_CURRENT_LIST_DIR}/launch_same_poll.sh" "${MOK}" "${WORK}/same_poll.log"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE so ERROR_VARIABLE se)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "mok launch with two ranks failing in one look: exit '${rc}' of the check\n${so}\n${se}")
  endif()
elseif(MODE STREQUAL "launch_witness")
  # `mok launch ARGS...` must exit with status `want_rc` and say `want` (a regex) on stderr;
  # the caller's `se` receives that stderr.
  function(expect_launch want_rc want what)
    run_mok(rc so se launch ${ARGN})
    if(NOT rc STREQUAL "${want_rc}" OR NOT se MATCHES "${want}")
      message(FATAL_ERROR "mok launch ${what} (rc '${rc}', wanted ${want_rc}):\n${se}")
    endif()
    set(se "${se}" PARENT_SCOPE)
  endfunction()
  # Ranks that exit with status 4 gave up waiting for their peers: they are witnesses, not
  # the failure. (1) Two witnesses and a rank that hangs: the hung one is named. (2) A
  # witness, then a rank failing for its own reason within the peer grace: that one is named.
  file(MAKE_DIRECTORY "${WORK}")
  file(WRITE "${WORK}/hang.sh" "if [ \"$MOK_RANK\" = 2 ]\nthen\n  exec sleep 300\nfi\nsleep 1\nexit 4\n")
  # (The culprit exits only after the witness did, whatever the machine's load.)
  file(REMOVE "${WORK}/witness_gone")
  file(WRITE "${WORK}/culprit.sh"
       "if [ \"$MOK_RANK\" = 0 ]\nthen\n  sleep 1\n  touch \"${WORK}/witness_gone\"\n  exit 4\nfi\n"
       "if [ \"$MOK_RANK\" = 2 ]\nthen\n  while [ ! -e \"${WORK}/witness_gone\" ]; do sleep 0.1; done\n  sleep 1\n  exit 2\nfi\n"
       "exec sleep 300\n")
  file(WRITE "${WORK}/all_witnesses.sh" "sleep 1\nexit 4\n")
  string(TIMESTAMP t0 "%s")
  expect_launch(4 "rank 2 still running [0-9.]+ s after rank [01] gave up waiting" "did not name the hung rank"
                -n 3 --peer-grace 3 -- sh "${WORK}/hang.sh")
  string(TIMESTAMP t1 "%s")
  math(EXPR elapsed "${t1} - ${t0}")
  if(elapsed GREATER 30)
    message(FATAL_ERROR "mok launch took ${elapsed} s to name the hung rank (peer grace 3 s)")
  endif()
  expect_launch(2 "failed: rank 2 exited with status 2" "did not name the rank that failed for its own reason"
                -n 3 --peer-grace 20 -- sh "${WORK}/culprit.sh")
  if(NOT se MATCHES "rank 0 gave up waiting for its peers; looking for the rank that failed")
    message(FATAL_ERROR "mok launch did not wait for the culprit after the witness:\n${se}")
  endif()
  # (3) Every rank gave up on its peers: the first witness is named, with status 4.
  expect_launch(4 "failed: rank [012] gave up waiting for its peers, and no rank failed" "with only witnesses"
                -n 3 --peer-grace 20 -- sh "${WORK}/all_witnesses.sh")
  expect_refused("option --peer-grace: -1 is out of range [0, 1e+07] seconds (to wait for the culprit"
                 launch -n 1 --peer-grace -1 -- true)
  expect_refused("option --grace: 1e300 is out of range [0, 1e+07] seconds (between SIGTERM and SIGKILL"
                 launch -n 1 --grace 1e300 -- true)
elseif(MODE STREQUAL "launch_signals")
  # Signals to the launcher (tests/launch_signals.sh says which): SIGCHLD ignored by its
  # parent, SIGHUP ignored from the start, a second signal while stopping, a signal while
  # stopping a rank's leftovers, a SIGTERM right after the forks.
  execute_process(COMMAND sh "${CMAKE_CURRENT_LIST_DIR}/launch_signals.sh" "${MOK}" "${WORK}" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE so ERROR_VARIABLE se)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "mok launch and signals: exit '${rc}' of the check\n${so}\n${se}")
  endif()
elseif(MODE MATCHES "^launch_")
  message(FATAL_ERROR "cli_test.cmake: unknown MODE '${MODE}'")
endif()
