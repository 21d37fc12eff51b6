// The IPluginV3 boilerplate every attnx op shares, once: PluginV3 (a CRTP base implementing
// IPluginV3OneCore/Build/Runtime from a few static facts of the op) and PluginCreatorV3 (the
// IPluginCreatorV3One for it). Name = op_type, version "1", namespace "attnx"; attributes are
// PluginFields (serialized through getFieldsToSerialize); linear format; fp32 | fp16 inputs of
// one type; int64 outputs where the op says so; shapes validated at build time, at the
// profile's min and max shapes (configurePlugin) and at run time (onShapeChange), with messages
// that name the node.
//
// An op `class Op final : public PluginV3<Op, Params>` supplies
//   static constexpr char const* kName;                    plugin name = ONNX op_type
//   static constexpr int32_t kNbInputs, kNbOutputs;
//   static constexpr int32_t kFirstInt64Output;            outputs from here on are int64 (-1: none)
//   static constexpr char const* kIoNames[];               input then output names, for messages
//   static constexpr int32_t kInputRanks[];                 rank of each input (checked first)
//   static void checkShapes(nvinfer1::Dims const* inputs, ShapeChecker& c);  the op's rules between
//                                                           dims (inputs of the right ranks; -1 = unknown)
//   static void outputShapes(nvinfer1::DimsExprs const* inputs, nvinfer1::DimsExprs* outputs,
//                            nvinfer1::IExprBuilder& exprBuilder);
//   int launch(int dtype, nvinfer1::PluginTensorDesc const* inputDesc, void const* const* inputs,
//              void* const* outputs, void* workspace, cudaStream_t stream) const noexcept;  // cudaError
// and, when it has attributes (Params other than NoParams),
//   static void describeFields(Params* params, std::vector<nvinfer1::PluginField>& out);  // null: names only
//   static bool parseFields(std::string const& node, nvinfer1::PluginFieldCollection const* fc, Params& params);
// It may override getWorkspaceSize (IPluginV3OneBuild) directly.
#ifndef ATTNX_PLUGIN_V3_H
#define ATTNX_PLUGIN_V3_H

#include "common/plugin_common.h"

#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace attnx
{
namespace plugin
{

//! Params of an op without attributes.
struct NoParams
{
};

template <class Derived, class Params = NoParams>
class PluginV3 : public PluginBase
{
public:
    using ParamsType = Params;

    PluginV3(std::string nodeName, Params const& params)
        : PluginBase(Derived::kName, std::move(nodeName))
        , mParams(params)
    {
        bindFields();
    }
    PluginV3(PluginV3 const& other)
        : PluginBase(other)
        , mParams(other.mParams)
    {
        bindFields();
    }

    // Attribute-less ops: no fields, nothing to parse.
    static void describeFields(NoParams* /*params*/, std::vector<nvinfer1::PluginField>& /*out*/) {}
    static bool parseFields(std::string const& /*node*/, nvinfer1::PluginFieldCollection const* /*fc*/, NoParams& /*params*/)
    {
        return true;
    }

    // IPluginV3
    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            return new Derived(static_cast<Derived const&>(*this));
        }
        catch (...)
        {
            return nullptr;
        }
    }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override
    {
        return Derived::kNbOutputs;
    }

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        try
        {
            if (!counts(nbInputs, nbOutputs) || outputTypes == nullptr)
            {
                return fail(countMessage(nbInputs, nbOutputs));
            }
            if (checkInputTypes(inputTypes, nbInputs, Derived::kIoNames) != 0)
            {
                return -1;
            }
            for (int32_t i = 0; i < nbOutputs; ++i)
            {
                outputTypes[i] = isInt64Output(i) ? nvinfer1::DataType::kINT64 : inputTypes[0];
            }
            return 0;
        }
        catch (...)
        {
            return fail("unexpected exception in getOutputDataTypes");
        }
    }

    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* /*shapeInputs*/,
        int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override
    {
        try
        {
            if (!counts(nbInputs, nbOutputs) || inputs == nullptr || outputs == nullptr)
            {
                return fail(countMessage(nbInputs, nbOutputs));
            }
            nvinfer1::Dims dims[Derived::kNbInputs];
            for (int32_t i = 0; i < Derived::kNbInputs; ++i)
            {
                dims[i] = constantDims(inputs[i]);
            }
            std::string const error = shapeErrors(dims);
            if (!error.empty())
            {
                return fail(error);
            }
            Derived::outputShapes(inputs, outputs, exprBuilder);
            return 0;
        }
        catch (...)
        {
            return fail("unexpected exception in getOutputShapes");
        }
    }

    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override
    {
        if (!counts(nbInputs, nbOutputs))
        {
            return false;
        }
        return supportsFloatAndInt64(pos, inOut, nbInputs, nbOutputs, Derived::kFirstInt64Output, Derived::kIoNames);
    }

    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override
    {
        try
        {
            if (!counts(nbInputs, nbOutputs) || in == nullptr || out == nullptr)
            {
                return fail(countMessage(nbInputs, nbOutputs));
            }
            nvinfer1::DataType types[Derived::kNbInputs];
            nvinfer1::Dims dims[Derived::kNbInputs];
            for (int32_t i = 0; i < Derived::kNbInputs; ++i)
            {
                types[i] = in[i].desc.type;
            }
            if (checkInputTypes(types, nbInputs, Derived::kIoNames) != 0)
            {
                return -1;
            }
            for (bool const useMin : {true, false})
            {
                for (int32_t i = 0; i < Derived::kNbInputs; ++i)
                {
                    dims[i] = useMin ? in[i].min : in[i].max;
                }
                std::string const error = shapeErrors(dims);
                if (!error.empty())
                {
                    return fail(error + (useMin ? " (at the profile's min shapes)" : " (at the profile's max shapes)"));
                }
            }
            return 0;
        }
        catch (...)
        {
            return fail("unexpected exception in configurePlugin");
        }
    }

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* /*out*/,
        int32_t nbOutputs) noexcept override
    {
        try
        {
            if (!counts(nbInputs, nbOutputs) || in == nullptr)
            {
                return fail(countMessage(nbInputs, nbOutputs));
            }
            nvinfer1::Dims dims[Derived::kNbInputs];
            for (int32_t i = 0; i < Derived::kNbInputs; ++i)
            {
                dims[i] = in[i].dims;
            }
            std::string const error = shapeErrors(dims);
            return error.empty() ? 0 : fail(error);
        }
        catch (...)
        {
            return fail("unexpected exception in onShapeChange");
        }
    }

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* /*outputDesc*/,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override
    {
        try
        {
            int const dtype = kernelDtype(inputDesc[0].type);
            if (dtype < 0)
            {
                return fail(std::string("cannot run with ") + dataTypeName(inputDesc[0].type) + " inputs");
            }
            int const status
                = static_cast<Derived const*>(this)->launch(dtype, inputDesc, inputs, outputs, workspace, stream);
            if (status != 0)
            {
                std::string shapes;
                for (int32_t i = 0; i < Derived::kNbInputs; ++i)
                {
                    shapes += std::string(i ? ", " : "") + Derived::kIoNames[i] + " " + dimsToString(inputDesc[i].dims);
                }
                return fail("kernel launch failed (cudaError " + std::to_string(status) + ") for " + shapes);
            }
            return 0;
        }
        catch (...)
        {
            return fail("unexpected exception in enqueue");
        }
    }

    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        return &mFieldCollection;
    }

protected:
    Params const& params() const noexcept
    {
        return mParams;
    }

    //! Empty when the input dims are consistent (ranks, then the op's rules), else the reasons.
    static std::string shapeErrors(nvinfer1::Dims const* dims)
    {
        ShapeChecker c;
        bool ranks = true;
        for (int32_t i = 0; i < Derived::kNbInputs; ++i)
        {
            ranks = c.rank(Derived::kIoNames[i], dims[i], Derived::kInputRanks[i]) && ranks;
        }
        if (ranks)
        {
            Derived::checkShapes(dims, c);
        }
        return c.error();
    }

private:
    static bool counts(int32_t nbInputs, int32_t nbOutputs) noexcept
    {
        return nbInputs == Derived::kNbInputs && nbOutputs == Derived::kNbOutputs;
    }

    static bool isInt64Output(int32_t index) noexcept
    {
        return Derived::kFirstInt64Output >= 0 && index >= Derived::kFirstInt64Output;
    }

    //! "expects 3 inputs (a, b, c) and 1 output (d), got 2 and 1".
    static std::string countMessage(int32_t nbInputs, int32_t nbOutputs)
    {
        auto names = [](int32_t first, int32_t n) {
            std::string s;
            for (int32_t i = 0; i < n; ++i)
            {
                s += std::string(i ? ", " : "") + Derived::kIoNames[first + i];
            }
            return s;
        };
        int32_t const nIn = Derived::kNbInputs;
        int32_t const nOut = Derived::kNbOutputs;
        return "expects " + std::to_string(nIn) + " inputs (" + names(0, nIn) + ") and " + std::to_string(nOut)
            + (nOut == 1 ? " output (" : " outputs (") + names(nIn, nOut) + "), got " + std::to_string(nbInputs)
            + " and " + std::to_string(nbOutputs);
    }

    void bindFields()
    {
        mFields.clear();
        Derived::describeFields(&mParams, mFields);
        mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
        mFieldCollection.fields = mFields.empty() ? nullptr : mFields.data();
    }

    Params mParams;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

//! The IPluginCreatorV3One of a PluginV3 op: field names from describeFields, attributes
//! parsed by parseFields (which logs why it refuses), the node's name kept for messages.
template <class Plugin>
class PluginCreatorV3 final : public nvinfer1::IPluginCreatorV3One
{
public:
    PluginCreatorV3()
    {
        Plugin::describeFields(nullptr, mFields);
        mFieldCollection.nbFields = static_cast<int32_t>(mFields.size());
        mFieldCollection.fields = mFields.empty() ? nullptr : mFields.data();
    }

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept override
    {
        try
        {
            std::string const node = name != nullptr ? name : "";
            typename Plugin::ParamsType params{};
            if (!Plugin::parseFields(node, fc, params))
            {
                return nullptr;
            }
            return new Plugin(node, params);
        }
        catch (...)
        {
            return nullptr;
        }
    }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        return &mFieldCollection;
    }
    char const* getPluginName() const noexcept override
    {
        return Plugin::kName;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

} // namespace plugin
} // namespace attnx

#endif // ATTNX_PLUGIN_V3_H
