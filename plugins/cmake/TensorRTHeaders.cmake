# Locate TensorRT's C++ API headers (NvInferRuntime.h and friends) for the attnx plugins.
#
# Order:
#   1. TENSORRT_INCLUDE_DIR (CMake variable or environment): used as given, must hold NvInferRuntime.h.
#   2. TensorRT_ROOT / TENSORRT_ROOT (CMake variable or environment): <root>/include.
#   3. A TensorRT install in the usual places (/usr/include/x86_64-linux-gnu, /usr/local/TensorRT, ...).
#   4. Unless ATTNX_FETCH_TENSORRT_HEADERS is OFF: NVIDIA's public API headers (Apache-2.0) from the
#      PyPI wheel kernel-lens (kernel_lens/include/tensorrt/), downloaded with `pip download --no-deps`
#      into the build folder; only the headers are extracted. ATTNX_TENSORRT_HEADERS_WHEEL may name
#      an already-downloaded wheel (offline builds). Nothing is written to the source tree.
#
# Result: ATTNX_TENSORRT_INCLUDE_DIR, ATTNX_TENSORRT_VERSION, ATTNX_TENSORRT_HEADERS_SOURCE.
# The plugins use the interfaces only, so no TensorRT library is needed or linked.

set(ATTNX_KERNEL_LENS_REQUIREMENT "kernel-lens==2.0.1" CACHE STRING "pip requirement of the wheel carrying TensorRT headers")
option(ATTNX_FETCH_TENSORRT_HEADERS "Download TensorRT's public headers when no TensorRT install is found" ON)
set(ATTNX_TENSORRT_HEADERS_WHEEL "" CACHE FILEPATH "A local kernel-lens wheel to take the TensorRT headers from")

function(_attnx_tensorrt_version include_dir out_var)
  file(STRINGS "${include_dir}/NvInferVersion.h" _lines REGEX "#define (TRT_(MAJOR|MINOR|PATCH)_ENTERPRISE|NV_TENSORRT_(MAJOR|MINOR|PATCH)) +[0-9]+")
  set(_major "")
  set(_minor "")
  set(_patch "")
  foreach(_line IN LISTS _lines)
    if(_line MATCHES "(MAJOR)[A-Z_]* +([0-9]+)")
      set(_major "${CMAKE_MATCH_2}")
    elseif(_line MATCHES "(MINOR)[A-Z_]* +([0-9]+)")
      set(_minor "${CMAKE_MATCH_2}")
    elseif(_line MATCHES "(PATCH)[A-Z_]* +([0-9]+)")
      set(_patch "${CMAKE_MATCH_2}")
    endif()
  endforeach()
  set(${out_var} "${_major}.${_minor}.${_patch}" PARENT_SCOPE)
endfunction()

function(_attnx_check_include_dir dir what)
  if(NOT EXISTS "${dir}/NvInferRuntime.h" OR NOT EXISTS "${dir}/NvInferVersion.h")
    message(FATAL_ERROR "attnx plugins: ${what} is '${dir}', which has no NvInferRuntime.h / NvInferVersion.h. "
                        "Point it at TensorRT's include folder, or unset it to let the build find or download the headers.")
  endif()
endfunction()

set(ATTNX_TENSORRT_INCLUDE_DIR "")
set(ATTNX_TENSORRT_HEADERS_SOURCE "")

# 1. TENSORRT_INCLUDE_DIR
if(NOT TENSORRT_INCLUDE_DIR AND DEFINED ENV{TENSORRT_INCLUDE_DIR} AND NOT "$ENV{TENSORRT_INCLUDE_DIR}" STREQUAL "")
  set(TENSORRT_INCLUDE_DIR "$ENV{TENSORRT_INCLUDE_DIR}")
endif()
if(TENSORRT_INCLUDE_DIR)
  _attnx_check_include_dir("${TENSORRT_INCLUDE_DIR}" "TENSORRT_INCLUDE_DIR")
  set(ATTNX_TENSORRT_INCLUDE_DIR "${TENSORRT_INCLUDE_DIR}")
  set(ATTNX_TENSORRT_HEADERS_SOURCE "TENSORRT_INCLUDE_DIR")
endif()

# 2. TensorRT_ROOT / TENSORRT_ROOT
if(NOT ATTNX_TENSORRT_INCLUDE_DIR)
  foreach(_var TensorRT_ROOT TENSORRT_ROOT)
    set(_root "")
    if(${_var})
      set(_root "${${_var}}")
    elseif(DEFINED ENV{${_var}} AND NOT "$ENV{${_var}}" STREQUAL "")
      set(_root "$ENV{${_var}}")
    endif()
    if(_root)
      _attnx_check_include_dir("${_root}/include" "${_var}/include")
      set(ATTNX_TENSORRT_INCLUDE_DIR "${_root}/include")
      set(ATTNX_TENSORRT_HEADERS_SOURCE "${_var}")
      break()
    endif()
  endforeach()
endif()

# 3. A TensorRT install
if(NOT ATTNX_TENSORRT_INCLUDE_DIR)
  find_path(_ATTNX_TRT_SYSTEM_INCLUDE NvInferRuntime.h
    PATHS /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu /usr/local/TensorRT/include
          /usr/local/tensorrt/include /opt/tensorrt/include /usr/src/tensorrt/include /usr/include
    NO_DEFAULT_PATH)
  if(_ATTNX_TRT_SYSTEM_INCLUDE AND EXISTS "${_ATTNX_TRT_SYSTEM_INCLUDE}/NvInferVersion.h")
    set(ATTNX_TENSORRT_INCLUDE_DIR "${_ATTNX_TRT_SYSTEM_INCLUDE}")
    set(ATTNX_TENSORRT_HEADERS_SOURCE "TensorRT install")
  endif()
endif()

# 4. NVIDIA's public headers from the kernel-lens wheel, into the build folder
if(NOT ATTNX_TENSORRT_INCLUDE_DIR)
  if(NOT ATTNX_FETCH_TENSORRT_HEADERS)
    message(FATAL_ERROR "attnx plugins: TensorRT headers not found. Set TENSORRT_INCLUDE_DIR or TensorRT_ROOT "
                        "(or turn ATTNX_FETCH_TENSORRT_HEADERS on to download NVIDIA's public headers).")
  endif()
  set(_deps "${CMAKE_BINARY_DIR}/_deps/tensorrt-headers")
  set(_include "${_deps}/include")
  if(NOT EXISTS "${_include}/NvInferRuntime.h")
    find_package(Python3 COMPONENTS Interpreter)
    if(NOT Python3_Interpreter_FOUND)
      message(FATAL_ERROR "attnx plugins: TensorRT headers not found and no Python to download them with. "
                          "Set TENSORRT_INCLUDE_DIR or TensorRT_ROOT.")
    endif()
    set(_wheel "${ATTNX_TENSORRT_HEADERS_WHEEL}")
    if(NOT _wheel)
      message(STATUS "attnx plugins: no TensorRT install found; downloading NVIDIA's public headers "
                     "(${ATTNX_KERNEL_LENS_REQUIREMENT}) into ${_deps}")
      execute_process(
        COMMAND "${Python3_EXECUTABLE}" -m pip download --no-deps --disable-pip-version-check --quiet
                --dest "${_deps}/wheel" "${ATTNX_KERNEL_LENS_REQUIREMENT}"
        RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
      if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "attnx plugins: TensorRT headers not found, and downloading ${ATTNX_KERNEL_LENS_REQUIREMENT} "
                            "failed:\n${_err}\nSet TENSORRT_INCLUDE_DIR or TensorRT_ROOT to a TensorRT install "
                            "(or ATTNX_TENSORRT_HEADERS_WHEEL to a downloaded wheel).")
      endif()
      file(GLOB _wheels "${_deps}/wheel/kernel_lens-*.whl")
      list(SORT _wheels)
      list(GET _wheels -1 _wheel)
    endif()
    if(NOT EXISTS "${_wheel}")
      message(FATAL_ERROR "attnx plugins: wheel '${_wheel}' not found")
    endif()
    # Extract only kernel_lens/include/tensorrt/*.h (zipfile: no unzip tool needed).
    set(_extract [=[
import pathlib, sys, zipfile
wheel, out = sys.argv[1], pathlib.Path(sys.argv[2])
prefix = "kernel_lens/include/tensorrt/"
out.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".h") and "/" not in n[len(prefix):]]
    if not names:
        sys.exit("no " + prefix + "*.h in " + wheel)
    for n in names:
        (out / n[len(prefix):]).write_bytes(z.read(n))
print(len(names))
]=])
    execute_process(COMMAND "${Python3_EXECUTABLE}" -c "${_extract}" "${_wheel}" "${_include}"
                    RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
    if(NOT _rc EQUAL 0 OR NOT EXISTS "${_include}/NvInferRuntime.h")
      message(FATAL_ERROR "attnx plugins: could not extract the TensorRT headers from ${_wheel}:\n${_err}")
    endif()
  endif()
  set(ATTNX_TENSORRT_INCLUDE_DIR "${_include}")
  set(ATTNX_TENSORRT_HEADERS_SOURCE "${ATTNX_KERNEL_LENS_REQUIREMENT} (downloaded into the build folder)")
endif()

_attnx_tensorrt_version("${ATTNX_TENSORRT_INCLUDE_DIR}" ATTNX_TENSORRT_VERSION)
if(ATTNX_TENSORRT_VERSION VERSION_LESS 10.0)
  message(FATAL_ERROR "attnx plugins: TensorRT headers in ${ATTNX_TENSORRT_INCLUDE_DIR} are version "
                      "${ATTNX_TENSORRT_VERSION}; IPluginV3 needs 10.0 or newer.")
endif()
message(STATUS "attnx plugins: TensorRT ${ATTNX_TENSORRT_VERSION} headers from ${ATTNX_TENSORRT_HEADERS_SOURCE}: "
               "${ATTNX_TENSORRT_INCLUDE_DIR}")
